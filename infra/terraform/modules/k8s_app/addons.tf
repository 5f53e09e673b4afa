# Cluster add-ons Multiplex depends on: the NVIDIA device plugin (nvidia.com/gpu resources), metrics-server
# (CPU autoscaling) and the cluster autoscaler (GPU nodes follow pending engine pods).

resource "helm_release" "nvidia_device_plugin" {
  count            = var.install_nvidia_device_plugin ? 1 : 0
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = var.chart_versions.nvidia_device_plugin
  namespace        = "nvidia-device-plugin"
  create_namespace = true

  values = [yamlencode({
    nodeSelector = var.gpu_node_selector
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
}

resource "helm_release" "metrics_server" {
  count      = var.install_metrics_server ? 1 : 0
  name       = "metrics-server"
  repository = "https://kubernetes-sigs.github.io/metrics-server/"
  chart      = "metrics-server"
  version    = var.chart_versions.metrics_server
  namespace  = "kube-system"

  values = [yamlencode({
    nodeSelector = var.cpu_node_selector
    replicas     = 2
  })]
}

resource "helm_release" "cluster_autoscaler" {
  count      = var.install_cluster_autoscaler ? 1 : 0
  name       = "cluster-autoscaler"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = var.chart_versions.cluster_autoscaler
  namespace  = "kube-system"

  values = [yamlencode({
    cloudProvider = "aws"
    awsRegion     = var.aws_region
    autoDiscovery = { clusterName = var.cluster_name }
    nodeSelector  = var.cpu_node_selector
    rbac = {
      serviceAccount = {
        name        = "cluster-autoscaler"
        annotations = { "eks.amazonaws.com/role-arn" = var.cluster_autoscaler_role_arn }
      }
    }
    extraArgs = {
      "balance-similar-node-groups" = true
      "expander"                    = "least-waste"
      # An idle p5 costs ~$100/hour: give it back after 15 minutes without engines.
      "scale-down-unneeded-time"      = "15m"
      "skip-nodes-with-local-storage" = false
    }
  })]

  lifecycle {
    precondition {
      condition     = var.cluster_autoscaler_role_arn != null
      error_message = "install_cluster_autoscaler needs cluster_autoscaler_role_arn (the eks module's output)."
    }
  }
}
