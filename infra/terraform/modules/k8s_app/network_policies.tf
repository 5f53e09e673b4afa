# Default deny in both directions, then exactly the paths Multiplex uses. Enforced by the VPC CNI network
# policy agent (enabled in the eks module).

locals {
  ns = kubernetes_namespace_v1.mplex.metadata[0].name
  # Kubelet probes arrive from the node's address, which is somewhere in the VPC.
  probe_sources = [var.vpc_cidr]
}

resource "kubernetes_network_policy_v1" "default_deny" {
  metadata {
    name      = "default-deny"
    namespace = local.ns
  }
  spec {
    pod_selector {}
    policy_types = ["Ingress", "Egress"]
  }
}

resource "kubernetes_network_policy_v1" "dns_and_data" {
  metadata {
    name      = "egress-dns-postgres-redis"
    namespace = local.ns
  }
  spec {
    pod_selector {
      match_labels = local.part_of
    }
    policy_types = ["Egress"]

    egress {
      to {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = "kube-system" }
        }
        pod_selector {
          match_labels = { "k8s-app" = "kube-dns" }
        }
      }
      ports {
        port     = "53"
        protocol = "UDP"
      }
      ports {
        port     = "53"
        protocol = "TCP"
      }
    }

    # RDS and ElastiCache live in the VPC's private subnets; their security groups do the fine-grained check.
    egress {
      to {
        ip_block {
          cidr = var.vpc_cidr
        }
      }
      ports {
        port     = "5432"
        protocol = "TCP"
      }
      ports {
        port     = "6379"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "aws_apis" {
  metadata {
    name      = "egress-aws-apis"
    namespace = local.ns
  }
  spec {
    pod_selector {
      match_expressions {
        key      = "app.kubernetes.io/component"
        operator = "In"
        values   = ["engine", "worker"] # the only pods with an AWS role: S3 and STS over HTTPS
      }
    }
    policy_types = ["Egress"]

    egress {
      to {
        ip_block {
          cidr = "0.0.0.0/0"
        }
      }
      ports {
        port     = "443"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "gateway" {
  metadata {
    name      = "gateway"
    namespace = local.ns
  }
  spec {
    pod_selector {
      match_labels = local.labels.gateway
    }
    policy_types = ["Ingress", "Egress"]

    # The public API: clients arrive through the NLB with their own source addresses.
    ingress {
      ports {
        port     = "8000"
        protocol = "TCP"
      }
    }

    egress {
      to {
        pod_selector {
          match_labels = local.labels.engine
        }
      }
      ports {
        port     = "8100"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "engine" {
  metadata {
    name      = "engine"
    namespace = local.ns
  }
  spec {
    pod_selector {
      match_labels = local.labels.engine
    }
    policy_types = ["Ingress"]

    ingress {
      from {
        pod_selector {
          match_labels = local.labels.gateway
        }
      }
      from {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = var.monitoring_namespace }
        }
      }
      dynamic "from" {
        for_each = local.probe_sources
        content {
          ip_block {
            cidr = from.value
          }
        }
      }
      ports {
        port     = "8100"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "metrics_port" {
  metadata {
    name      = "worker-and-beat-metrics"
    namespace = local.ns
  }
  spec {
    pod_selector {
      match_expressions {
        key      = "app.kubernetes.io/component"
        operator = "In"
        values   = ["worker", "beat"]
      }
    }
    policy_types = ["Ingress"]

    ingress {
      from {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = var.monitoring_namespace }
        }
      }
      dynamic "from" {
        for_each = local.probe_sources
        content {
          ip_block {
            cidr = from.value
          }
        }
      }
      ports {
        port     = "9100"
        protocol = "TCP"
      }
    }
  }
}
