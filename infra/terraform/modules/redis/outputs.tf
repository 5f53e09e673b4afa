output "primary_endpoint" {
  description = "Hostname of the primary (writes; follows failover)."
  value       = aws_elasticache_replication_group.this.primary_endpoint_address
}

output "reader_endpoint" {
  description = "Hostname load-balancing over the replicas."
  value       = aws_elasticache_replication_group.this.reader_endpoint_address
}

output "port" {
  description = "Port of the replication group."
  value       = aws_elasticache_replication_group.this.port
}

output "security_group_id" {
  description = "Security group of the cache."
  value       = aws_security_group.redis.id
}
