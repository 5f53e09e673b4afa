output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name <this>)."
  value       = module.eks.cluster_name
}

output "gateway_url" {
  description = "Public URL of the OpenAI-compatible API (empty until the NLB is provisioned)."
  value = module.app.gateway_load_balancer_hostname == null ? null : format(
    "%s://%s", var.gateway_tls_certificate_arn == null ? "http" : "https", module.app.gateway_load_balancer_hostname,
  )
}

output "adapter_bucket" {
  description = "Adapter bucket; upload the base model checkpoint to s3://<bucket>/models/base/ before the engines start."
  value       = module.adapters_bucket.bucket_name
}

output "database_address" {
  description = "PostgreSQL hostname (private)."
  value       = module.rds.address
}

output "redis_primary_endpoint" {
  description = "Redis primary hostname (private, TLS)."
  value       = module.redis.primary_endpoint
}

output "secret_arns" {
  description = "Secrets Manager ARNs of the database password, Redis AUTH token and MPLEX_SECRET_KEY."
  value       = module.secrets.secret_arns
}

output "grafana_admin_password" {
  description = "Grafana admin password (kubectl -n monitoring port-forward svc/kube-prometheus-stack-grafana 3000:80)."
  value       = module.app.grafana_admin_password
  sensitive   = true
}
