output "namespace" {
  description = "Namespace Multiplex runs in."
  value       = kubernetes_namespace_v1.mplex.metadata[0].name
}

output "gateway_service" {
  description = "Name of the gateway Service; with service_type LoadBalancer, `kubectl get svc` shows the NLB hostname."
  value       = kubernetes_service_v1.gateway.metadata[0].name
}

output "gateway_load_balancer_hostname" {
  description = "Hostname of the gateway's NLB (null until AWS has provisioned it, or with service_type ClusterIP)."
  value       = try(kubernetes_service_v1.gateway.status[0].load_balancer[0].ingress[0].hostname, null)
}

output "engine_service" {
  description = "Headless Service of the engines; pod N is engine-N.<service>.<namespace>.svc."
  value       = kubernetes_service_v1.engine.metadata[0].name
}

output "migration_job" {
  description = "Name of the migration Job of the current gateway image."
  value       = kubernetes_job_v1.migrate.metadata[0].name
}

output "grafana_admin_password" {
  description = "Grafana admin password (user admin), when the monitoring stack is installed."
  value       = var.install_monitoring ? random_password.grafana_admin[0].result : null
  sensitive   = true
}
