# Engines: a StatefulSet with one pod per engine; an engine spans `tensor_parallel_size` GPUs of one node (one
# tensor-parallel rank per GPU, NCCL over NVLink between them; docs/engine.md "Tensor parallelism"). Each pod keeps the base-model checkpoint on its own volume
# (synced from S3 by an init container, incremental across restarts), is ready only once the model is loaded,
# and drains its in-flight streams before it is stopped.

locals {
  engine_service      = "mplex-engine"
  engine_drain_budget = var.engine.termination_grace_period_seconds - 30 # leave time for SIGTERM shutdown itself
  engine_gpus         = tostring(var.engine.tensor_parallel_size)
  # NCCL between the ranks of one pod: NVLink peer-to-peer and shared memory inside the node, never the network;
  # a collective on a dead rank errors out (the engine then goes dead and the pod restarts) instead of hanging.
  engine_nccl_env = merge({
    NCCL_DEBUG                      = "WARN"
    NCCL_P2P_LEVEL                  = "NVL"
    NCCL_IB_DISABLE                 = "1"
    NCCL_SOCKET_IFNAME              = "lo"
    TORCH_NCCL_ASYNC_ERROR_HANDLING = "1"
    TORCH_NCCL_BLOCKING_WAIT        = "0"
  }, var.engine.nccl_env)
}

resource "kubernetes_service_v1" "engine" {
  metadata {
    name      = local.engine_service
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = merge(local.labels.engine, { "mplex.ai/scrape" = "true" })
  }

  # Headless: the gateway routes to individual engines it finds in the Redis registry, by their stable DNS names.
  spec {
    cluster_ip = "None"
    selector   = local.labels.engine

    port {
      name        = "http"
      port        = 8100
      target_port = "http"
    }
  }
}

resource "kubernetes_stateful_set_v1" "engine" {
  #checkov:skip=CKV_K8S_43:The image reference is an input (engine_image); production passes an @sha256 digest, which the variable validation accepts.
  metadata {
    name      = "mplex-engine"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.engine
  }

  spec {
    service_name          = kubernetes_service_v1.engine.metadata[0].name
    replicas              = var.engine.min_replicas
    pod_management_policy = "Parallel" # engines are independent; start and stop them together

    selector {
      match_labels = local.labels.engine
    }

    update_strategy {
      type = "RollingUpdate"
      rolling_update {
        partition = 0
      }
    }

    persistent_volume_claim_retention_policy {
      when_deleted = "Delete"
      when_scaled  = "Retain" # a scaled-in engine that comes back finds its weights already synced
    }

    template {
      metadata {
        labels = local.labels.engine
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.engine.metadata[0].name
        automount_service_account_token  = false
        node_selector                    = merge(var.gpu_node_selector, var.engine.node_selector)
        termination_grace_period_seconds = var.engine.termination_grace_period_seconds

        toleration {
          key      = local.gpu_toleration.key
          operator = local.gpu_toleration.operator
          effect   = local.gpu_toleration.effect
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

        init_container {
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

        container {
          name              = "engine"
          image             = var.engine_image
          image_pull_policy = "Always"
          # `serve` runs the engine core and its HTTP front-end(s) as children of one launcher (docs/engine.md,
          # "Processes"); their ZMQ socket lives under /tmp (the scratch volume). The container ends when the core does.
          command = ["mplex", "engine", "serve", "--model", "/models/base", "--host", "0.0.0.0", "--port", "8100"]
          args = concat(
            ["--served-model-name", var.engine.served_model_name, "--engine-id", "$(POD_NAME)",
            "--tensor-parallel-size", local.engine_gpus],
            var.engine.extra_args,
          )

          port {
            name           = "http"
            container_port = 8100
            protocol       = "TCP"
          }

          env {
            name = "POD_NAME"
            value_from {
              field_ref {
                field_path = "metadata.name"
              }
            }
          }
          # What the engine registers in Redis for the gateway's router: its stable per-pod DNS name.
          env {
            name  = "MPLEX_ENGINE_ADVERTISE_URL"
            value = "http://$(POD_NAME).${local.engine_service}.${var.namespace}.svc.cluster.local:8100"
          }
          dynamic "env" {
            for_each = local.engine_nccl_env
            content {
              name  = env.key
              value = env.value
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

          # Guaranteed QoS: whole GPUs (one per tensor-parallel rank, all on one node) and the CPU/memory share
          # of them on a p5.48xlarge (192 vCPU, 2 TiB, 8 GPUs); var.engine.cpu/memory are the pod's.
          resources {
            requests = { cpu = var.engine.cpu, memory = var.engine.memory, "nvidia.com/gpu" = local.engine_gpus, "ephemeral-storage" = "20Gi" }
            limits   = { cpu = var.engine.cpu, memory = var.engine.memory, "nvidia.com/gpu" = local.engine_gpus, "ephemeral-storage" = "40Gi" }
          }

          # Loading tens of GB of weights takes minutes: liveness waits for the start-up probe.
          startup_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 10
            failure_threshold = 90
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 10
            timeout_seconds   = 5
            failure_threshold = 6
          }

          readiness_probe {
            http_get {
              path = "/health" # model loaded, step loop running; the only engine path open without the credential
              port = "http"
            }
            period_seconds    = 5
            timeout_seconds   = 3
            failure_threshold = 2
          }

          # Stop taking new work, then wait for running and waiting sequences to finish (bounded), before SIGTERM.
          lifecycle {
            pre_stop {
              exec {
                command = ["python", "/opt/mplex/engine_drain.py", "--port", "8100", "--timeout", tostring(local.engine_drain_budget)]
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
            name       = "models"
            mount_path = "/models"
            read_only  = true
          }
          volume_mount {
            name       = "scratch"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "state"
            mount_path = "/var/lib/mplex" # adapter host cache, by content hash
          }
          volume_mount {
            name       = "dshm"
            mount_path = "/dev/shm"
          }
        }

        volume {
          name = "scratch"
          empty_dir {
            size_limit = "20Gi"
          }
        }
        volume {
          name = "state"
          empty_dir {
            size_limit = "50Gi"
          }
        }
        # NCCL (its intra-node transport between the tensor-parallel ranks) and pinned-memory transfers use shared
        # memory; the container default of 64 MiB is far too small. 16 GiB, and 8 GiB per rank beyond two.
        volume {
          name = "dshm"
          empty_dir {
            medium     = "Memory"
            size_limit = "${max(16, 8 * var.engine.tensor_parallel_size)}Gi"
          }
        }
      }
    }

    volume_claim_template {
      metadata {
        name = "models"
      }
      spec {
        access_modes       = ["ReadWriteOnce"]
        storage_class_name = kubernetes_storage_class_v1.models.metadata[0].name
        resources {
          requests = {
            storage = var.engine.model_volume_size
          }
        }
      }
    }
  }

  lifecycle {
    ignore_changes = [spec[0].replicas]
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.nvidia_device_plugin]
}

# Engines scale on their own backlog: requests waiting for admission, and KV occupancy (a full cache means
# admission stalls and preemption starts). Both come from prometheus-adapter.
resource "kubernetes_horizontal_pod_autoscaler_v2" "engine" {
  count = var.install_monitoring ? 1 : 0

  metadata {
    name      = "mplex-engine"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.engine
  }

  spec {
    min_replicas = var.engine.min_replicas
    max_replicas = var.engine.max_replicas

    scale_target_ref {
      api_version = "apps/v1"
      kind        = "StatefulSet"
      name        = kubernetes_stateful_set_v1.engine.metadata[0].name
    }

    metric {
      type = "Pods"
      pods {
        metric {
          name = "mplex_engine_requests_waiting"
        }
        target {
          type          = "AverageValue"
          average_value = tostring(var.engine.target_waiting_requests)
        }
      }
    }

    metric {
      type = "Pods"
      pods {
        metric {
          name = "mplex_engine_kv_occupancy"
        }
        target {
          type          = "AverageValue"
          average_value = "${floor(var.engine.target_kv_occupancy * 1000)}m"
        }
      }
    }

    # A new engine takes minutes (GPU node, image, weights): scale up promptly, scale down reluctantly.
    behavior {
      scale_up {
        stabilization_window_seconds = 60
        select_policy                = "Max"
        policy {
          type           = "Pods"
          value          = 2
          period_seconds = 120
        }
      }
      scale_down {
        stabilization_window_seconds = 1200
        select_policy                = "Min"
        policy {
          type           = "Pods"
          value          = 1
          period_seconds = 600
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "engine" {
  metadata {
    name      = "mplex-engine"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.engine
  }
  spec {
    max_unavailable = "1"
    selector {
      match_labels = local.labels.engine
    }
  }
}
