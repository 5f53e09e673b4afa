output "address" {
  description = "Hostname of the DB instance."
  value       = aws_db_instance.this.address
}

output "port" {
  description = "Port of the DB instance."
  value       = aws_db_instance.this.port
}

output "database_name" {
  description = "Name of the application database."
  value       = aws_db_instance.this.db_name
}

output "username" {
  description = "Master user name."
  value       = aws_db_instance.this.username
}

output "resource_id" {
  description = "DbiResourceId, needed in rds-db:connect IAM policies for IAM database authentication."
  value       = aws_db_instance.this.resource_id
}

output "security_group_id" {
  description = "Security group of the database."
  value       = aws_security_group.db.id
}

output "kms_key_arn" {
  description = "KMS key encrypting storage, snapshots and Performance Insights."
  value       = aws_kms_key.db.arn
}
