# Celery: one Deployment per queue so each scales on its own backlog, and one beat that must never run twice.
# GPU workers (the adapter quality gate) run from the engine image with the base model on an ephemeral volume.

resource "kubernetes_deployment_v1" "worker" {
  #checkov:skip=CKV_K8S_43:Image references are inputs (gateway_image, engine_image); production passes @sha256 digests, which the variable validation accepts.
  #checkov:skip=CKV_K8S_10:Requests and limits are always set (cpu, memory from var.workers, plus a GPU for gpu pools) through merge(), which checkov cannot evaluate.
  #checkov:skip=CKV_K8S_11:Same: CPU limits are set through merge().
  #checkov:skip=CKV_K8S_12:Same: memory limits are set through merge().
  #checkov:skip=CKV_K8S_13:Same: memory requests are set through merge().
  for_each = var.workers

  metadata {
    name      = "mplex-worker-${each.key}"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.worker_labels[each.key]
  }

  spec {
    replicas = each.value.min_replicas

    selector {
      match_labels = local.worker_labels[each.key]
    }

    strategy {
      type = "RollingUpdate"
      rolling_update {
        max_surge       = each.value.gpu ? "0" : "1" # a surge pod would wait for a free GPU
        max_unavailable = "1"
      }
    }

    template {
      metadata {
        labels = local.worker_labels[each.key]
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.worker.metadata[0].name
        automount_service_account_token  = false
        node_selector                    = each.value.gpu ? var.gpu_node_selector : var.cpu_node_selector
        termination_grace_period_seconds = each.value.termination_grace_secs # tasks are acks_late: a cut-off one is redelivered

        dynamic "toleration" {
          for_each = each.value.gpu ? [local.gpu_toleration] : []
          content {
            key      = toleration.value.key
            operator = toleration.value.operator
            effect   = toleration.value.effect
          }
        }

        security_context {
          run_as_non_root = true
          run_as_user     = local.uid
          run_as_group    = local.uid
          fs_group        = local.uid
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        dynamic "init_container" {
          for_each = each.value.gpu ? [1] : []
          content {
            name              = "model-sync"
            image             = var.model_sync_image
            image_pull_policy = "IfNotPresent"
            command = [
              "aws", "s3", "sync", "--only-show-errors", "--no-progress", "--delete",
              "s3://${var.storage_bucket}/${var.base_model_prefix}/", "/models/base/",
            ]
            env {
              name  = "AWS_REGION"
              value = var.aws_region
            }
            env {
              name  = "HOME"
              value = "/tmp"
            }
            resources {
              requests = { cpu = "2", memory = "2Gi" }
              limits   = { cpu = "4", memory = "4Gi" }
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
              name       = "models"
              mount_path = "/models"
            }
            volume_mount {
              name       = "scratch"
              mount_path = "/tmp"
            }
          }
        }

        container {
          name              = "worker"
          image             = each.value.gpu ? var.engine_image : var.gateway_image
          image_pull_policy = "Always"
          command           = ["mplex", "worker", "--queues", each.value.queue]

          port {
            name           = "metrics"
            container_port = 9100
            protocol       = "TCP"
          }

          # The metrics port binds loopback unless told otherwise: bind the pod IP, where the kubelet probes and
          # Prometheus scrapes (the network policy "worker-and-beat-metrics" limits who may).
          env {
            name = "MPLEX_WORKER_METRICS_HOST"
            value_from {
              field_ref {
                field_path = "status.podIP"
              }
            }
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
          dynamic "env" {
            for_each = each.value.gpu ? { MPLEX_BASE_MODEL_DIR = "/models/base" } : {}
            content {
              name  = env.key
              value = env.value
            }
          }

          resources {
            requests = merge(
              { cpu = each.value.cpu, memory = each.value.memory, "ephemeral-storage" = "2Gi" },
              each.value.gpu ? { "nvidia.com/gpu" = "1" } : {},
            )
            limits = merge(
              { cpu = each.value.cpu, memory = each.value.memory, "ephemeral-storage" = "10Gi" },
              each.value.gpu ? { "nvidia.com/gpu" = "1" } : {},
            )
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "metrics"
            }
            initial_delay_seconds = 10
            period_seconds        = 15
            timeout_seconds       = 5
            failure_threshold     = 4
          }

          readiness_probe {
            http_get {
              path = "/ready" # broker and database reachable
              port = "metrics"
            }
            period_seconds    = 10
            timeout_seconds   = 5
            failure_threshold = 3
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
          dynamic "volume_mount" {
            for_each = each.value.gpu ? [1] : []
            content {
              name       = "models"
              mount_path = "/models"
              read_only  = true
            }
          }
        }

        volume {
          name = "scratch"
          empty_dir {
            size_limit = "20Gi" # uploaded archives are unpacked and checked here
          }
        }
        volume {
          name = "state"
          empty_dir {
            size_limit = "20Gi"
          }
        }
        dynamic "volume" {
          for_each = each.value.gpu ? [1] : []
          content {
            name = "models"
            ephemeral {
              volume_claim_template {
                metadata {
                  labels = local.worker_labels[each.key]
                }
                spec {
                  access_modes       = ["ReadWriteOnce"]
                  storage_class_name = kubernetes_storage_class_v1.models.metadata[0].name
                  resources {
                    requests = {
                      storage = each.value.scratch_volume_size
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }

  lifecycle {
    ignore_changes = [spec[0].replicas]
  }

  depends_on = [kubernetes_job_v1.migrate]
}

resource "kubernetes_service_v1" "worker_metrics" {
  metadata {
    name      = "mplex-worker-metrics"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = merge(local.part_of, { "app.kubernetes.io/component" = "worker", "mplex.ai/scrape" = "true" })
  }

  spec {
    cluster_ip = "None"
    selector   = { "app.kubernetes.io/part-of" = "multiplex", "app.kubernetes.io/component" = "worker" }

    port {
      name        = "metrics"
      port        = 9100
      target_port = "metrics"
    }
  }
}

# Each worker pool scales on its own queue's depth (prometheus-adapter external metric, max over the workers
# that report it): target_depth_per_pod waiting tasks per replica.
resource "kubernetes_horizontal_pod_autoscaler_v2" "worker" {
  for_each = var.install_monitoring ? var.workers : {}

  metadata {
    name      = "mplex-worker-${each.key}"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.worker_labels[each.key]
  }

  spec {
    min_replicas = each.value.min_replicas
    max_replicas = each.value.max_replicas

    scale_target_ref {
      api_version = "apps/v1"
      kind        = "Deployment"
      name        = kubernetes_deployment_v1.worker[each.key].metadata[0].name
    }

    metric {
      type = "External"
      external {
        metric {
          name = "mplex_worker_queue_depth"
          selector {
            match_labels = { queue = each.value.queue }
          }
        }
        target {
          type          = "AverageValue"
          average_value = tostring(each.value.target_depth_per_pod)
        }
      }
    }

    behavior {
      scale_down {
        stabilization_window_seconds = 600
        select_policy                = "Min"
        policy {
          type           = "Pods"
          value          = 1
          period_seconds = 120
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "worker" {
  for_each = var.workers

  metadata {
    name      = "mplex-worker-${each.key}"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.worker_labels[each.key]
  }
  spec {
    max_unavailable = "1"
    selector {
      match_labels = local.worker_labels[each.key]
    }
  }
}

# Beat: exactly one replica, and Recreate so a rollout never has two schedulers enqueueing the same roll-up.
resource "kubernetes_deployment_v1" "beat" {
  #checkov:skip=CKV_K8S_14:The image is an input checkov cannot resolve; its validation demands an explicit :tag or @sha256 digest, never latest or blank.
  #checkov:skip=CKV_K8S_43:The image reference is an input (gateway_image); production passes an @sha256 digest, which the variable validation accepts.
  metadata {
    name      = "mplex-beat"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.beat
  }

  spec {
    replicas = 1

    selector {
      match_labels = local.labels.beat
    }

    strategy {
      type = "Recreate"
    }

    template {
      metadata {
        labels = local.labels.beat
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.beat.metadata[0].name
        automount_service_account_token  = false
        node_selector                    = var.cpu_node_selector
        termination_grace_period_seconds = 30

        security_context {
          run_as_non_root = true
          run_as_user     = local.uid
          run_as_group    = local.uid
          fs_group        = local.uid
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "beat"
          image             = var.gateway_image
          image_pull_policy = "Always"
          command           = ["mplex", "beat"]
          working_dir       = "/var/lib/mplex" # beat keeps its schedule state file in the working directory

          port {
            name           = "metrics"
            container_port = 9100
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
            requests = { cpu = var.beat_resources.cpu, memory = var.beat_resources.memory, "ephemeral-storage" = "256Mi" }
            limits   = { cpu = var.beat_resources.cpu, memory = var.beat_resources.memory, "ephemeral-storage" = "1Gi" }
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "metrics"
            }
            initial_delay_seconds = 10
            period_seconds        = 30
            timeout_seconds       = 5
            failure_threshold     = 3
          }

          readiness_probe {
            http_get {
              path = "/ready"
              port = "metrics"
            }
            period_seconds    = 15
            timeout_seconds   = 5
            failure_threshold = 3
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
            size_limit = "256Mi"
          }
        }
        volume {
          name = "state"
          empty_dir {
            size_limit = "256Mi"
          }
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate]
}
