output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "HTTPS endpoint of the Kubernetes API."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64-encoded CA certificate of the Kubernetes API."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "cluster_security_group_id" {
  description = "Security group EKS attaches to the control plane and managed nodes; databases allow ingress from it."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "ARN of the IAM OIDC provider that IRSA roles trust."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_provider_host" {
  description = "Issuer host/path of the OIDC provider (no scheme), the prefix of IRSA trust-policy condition keys."
  value       = local.oidc_host
}

output "cluster_autoscaler_role_arn" {
  description = "IRSA role for the cluster autoscaler (service account kube-system/cluster-autoscaler)."
  value       = aws_iam_role.autoscaler.arn
}

output "gpu_node_labels" {
  description = "Labels on GPU nodes; engine pods select them."
  value       = local.gpu_labels
}

output "cpu_node_labels" {
  description = "Labels on CPU nodes; gateway and worker pods select them."
  value       = local.cpu_labels
}

output "addons_ready" {
  description = "IDs of the managed add-ons; depend on this before scheduling workloads that need volumes or DNS."
  value       = [aws_eks_addon.vpc_cni.id, aws_eks_addon.coredns.id, aws_eks_addon.ebs_csi.id, aws_eks_addon.kube_proxy.id]
}
