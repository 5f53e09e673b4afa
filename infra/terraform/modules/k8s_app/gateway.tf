# The gateway: stateless, N replicas spread over zones, behind an NLB (SSE streams pass through untouched).

resource "kubernetes_deployment_v1" "gateway" {
  #checkov:skip=CKV_K8S_14:The image is an input checkov cannot resolve; its validation demands an explicit :tag or @sha256 digest, never latest or blank.
  #checkov:skip=CKV_K8S_43:The image reference is an input (gateway_image); production passes an @sha256 digest, which the variable validation accepts.
  metadata {
    name      = "mplex-gateway"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.gateway
  }

  spec {
    replicas = var.gateway.min_replicas

    selector {
      match_labels = local.labels.gateway
    }

    strategy {
      type = "RollingUpdate"
      rolling_update {
        max_surge       = "25%"
        max_unavailable = "0"
      }
    }

    template {
      metadata {
        labels = local.labels.gateway
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.gateway.metadata[0].name
        automount_service_account_token  = false
        node_selector                    = var.cpu_node_selector
        termination_grace_period_seconds = 120 # long enough for open SSE streams to finish after the LB stops sending

        security_context {
          run_as_non_root = true
          run_as_user     = local.uid
          run_as_group    = local.uid
          fs_group        = local.uid
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        topology_spread_constraint {
          max_skew           = 1
          topology_key       = "topology.kubernetes.io/zone"
          when_unsatisfiable = "ScheduleAnyway"
          label_selector {
            match_labels = local.labels.gateway
          }
        }

        container {
          name              = "gateway"
          image             = var.gateway_image
          image_pull_policy = "Always"
          command           = ["mplex", "gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]

          port {
            name           = "http"
            container_port = 8000
            protocol       = "TCP"
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.env.metadata[0].name
            }
          }
          env_from {
            secret_ref {
              name = kubernetes_secret_v1.env.metadata[0].name
            }
          }

          resources {
            requests = { cpu = var.gateway.cpu, memory = var.gateway.memory, "ephemeral-storage" = "1Gi" }
            limits   = { cpu = var.gateway.cpu, memory = var.gateway.memory, "ephemeral-storage" = "2Gi" }
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 10
            timeout_seconds   = 3
            failure_threshold = 3
          }

          readiness_probe {
            http_get {
              path = "/ready" # Postgres and Redis reachable
              port = "http"
            }
            period_seconds    = 5
            timeout_seconds   = 3
            failure_threshold = 2
          }

          # The NLB keeps sending to a terminating pod until it has seen the endpoint go away: keep serving briefly.
          lifecycle {
            pre_stop {
              exec {
                command = ["sleep", "15"]
              }
            }
          }

          security_context {
            run_as_non_root            = true
            run_as_user                = local.uid
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false
            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "scratch"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "state"
            mount_path = "/var/lib/mplex"
          }
        }

        volume {
          name = "scratch"
          empty_dir {
            size_limit = "1Gi"
          }
        }
        volume {
          name = "state"
          empty_dir {
            size_limit = "1Gi"
          }
        }
      }
    }
  }

  lifecycle {
    ignore_changes = [spec[0].replicas] # the HPA owns the replica count
  }

  depends_on = [kubernetes_job_v1.migrate]
}

resource "kubernetes_service_v1" "gateway" {
  metadata {
    name      = "mplex-gateway"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.gateway
    annotations = var.gateway.service_type != "LoadBalancer" ? {} : merge(
      {
        "service.beta.kubernetes.io/aws-load-balancer-type"                              = "nlb"
        "service.beta.kubernetes.io/aws-load-balancer-internal"                          = tostring(var.gateway.internal_load_balancer)
        "service.beta.kubernetes.io/aws-load-balancer-cross-zone-load-balancing-enabled" = "true"
      },
      var.gateway.tls_certificate_arn == null ? {} : {
        "service.beta.kubernetes.io/aws-load-balancer-ssl-cert"               = var.gateway.tls_certificate_arn
        "service.beta.kubernetes.io/aws-load-balancer-ssl-ports"              = "https"
        "service.beta.kubernetes.io/aws-load-balancer-ssl-negotiation-policy" = "ELBSecurityPolicy-TLS13-1-2-2021-06"
      },
    )
  }

  spec {
    type                        = var.gateway.service_type
    selector                    = local.labels.gateway
    load_balancer_source_ranges = var.gateway.service_type == "LoadBalancer" ? var.gateway.load_balancer_source_ranges : null

    port {
      name        = var.gateway.tls_certificate_arn == null ? "http" : "https"
      port        = var.gateway.tls_certificate_arn == null ? 80 : 443
      target_port = "http"
      protocol    = "TCP"
    }
  }
}

# Separate in-cluster Service for Prometheus, so scraping does not depend on the load balancer.
resource "kubernetes_service_v1" "gateway_metrics" {
  metadata {
    name      = "mplex-gateway-metrics"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = merge(local.labels.gateway, { "mplex.ai/scrape" = "true" })
  }

  spec {
    type       = "ClusterIP"
    cluster_ip = "None"
    selector   = local.labels.gateway

    port {
      name        = "metrics"
      port        = 8000
      target_port = "http"
    }
  }
}

resource "kubernetes_horizontal_pod_autoscaler_v2" "gateway" {
  metadata {
    name      = "mplex-gateway"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.gateway
  }

  spec {
    min_replicas = var.gateway.min_replicas
    max_replicas = var.gateway.max_replicas

    scale_target_ref {
      api_version = "apps/v1"
      kind        = "Deployment"
      name        = kubernetes_deployment_v1.gateway.metadata[0].name
    }

    metric {
      type = "Resource"
      resource {
        name = "cpu"
        target {
          type                = "Utilization"
          average_utilization = var.gateway.target_cpu_utilization
        }
      }
    }

    # Requests/s per pod, served by prometheus-adapter from mplex_gateway_requests_total.
    dynamic "metric" {
      for_each = var.install_monitoring ? [1] : []
      content {
        type = "Pods"
        pods {
          metric {
            name = "mplex_gateway_requests_per_second"
          }
          target {
            type          = "AverageValue"
            average_value = tostring(var.gateway.target_requests_per_second)
          }
        }
      }
    }

    behavior {
      scale_up {
        stabilization_window_seconds = 0
        select_policy                = "Max"
        policy {
          type           = "Percent"
          value          = 100
          period_seconds = 30
        }
      }
      scale_down {
        stabilization_window_seconds = 300
        select_policy                = "Min"
        policy {
          type           = "Percent"
          value          = 20
          period_seconds = 60
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "gateway" {
  metadata {
    name      = "mplex-gateway"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.gateway
  }
  spec {
    max_unavailable = "1"
    selector {
      match_labels = local.labels.gateway
    }
  }
}
