output "bucket_name" {
  description = "Name of the adapter bucket."
  value       = aws_s3_bucket.adapters.id
}

output "bucket_arn" {
  description = "ARN of the adapter bucket."
  value       = aws_s3_bucket.adapters.arn
}

output "kms_key_arn" {
  description = "KMS key every object in the bucket is encrypted with; readers need kms:Decrypt on it, writers kms:GenerateDataKey."
  value       = aws_kms_key.bucket.arn
}

output "access_log_bucket_name" {
  description = "Bucket receiving the server access logs."
  value       = aws_s3_bucket.logs.id
}
