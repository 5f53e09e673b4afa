output "database_password" {
  description = "PostgreSQL master password."
  value       = random_password.database.result
  sensitive   = true
}

output "redis_auth_token" {
  description = "Redis AUTH token."
  value       = random_password.redis.result
  sensitive   = true
}

output "secret_key" {
  description = "MPLEX_SECRET_KEY."
  value       = random_password.secret_key.result
  sensitive   = true
}

output "engine_token" {
  description = "The engines' platform credential (the k8s_app module's engine_tokens)."
  value       = random_password.engine_token.result
  sensitive   = true
}

output "secret_arns" {
  description = "ARNs of the Secrets Manager secrets by name (database-password, redis-auth-token, secret-key, engine-token)."
  value       = { for k, s in aws_secretsmanager_secret.this : k => s.arn }
}

output "kms_key_arn" {
  description = "KMS key encrypting the secrets."
  value       = aws_kms_key.secrets.arn
}
