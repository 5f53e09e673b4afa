output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "CIDR block of the VPC (network policies allow database and cache traffic into it)."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "Private subnet IDs, one per AZ: EKS nodes, RDS and ElastiCache live here."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnet IDs, one per AZ: NAT gateways and the internet-facing load balancer."
  value       = aws_subnet.public[*].id
}

output "availability_zones" {
  description = "Availability zones the subnets are spread over."
  value       = local.azs
}

output "nat_public_ips" {
  description = "Egress IPs of the NAT gateways (for allow-lists elsewhere)."
  value       = aws_eip.nat[*].public_ip
}
