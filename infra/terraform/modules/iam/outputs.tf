output "engine_role_arn" {
  description = "IRSA role of the engine service account (read-only on the adapter bucket)."
  value       = aws_iam_role.this["engine"].arn
}

output "worker_role_arn" {
  description = "IRSA role of the worker service account (reads and writes the adapter bucket)."
  value       = aws_iam_role.this["worker"].arn
}
