# Schema migrations run once per image, to completion, before any Deployment of that image rolls out.

resource "kubernetes_job_v1" "migrate" {
  #checkov:skip=CKV_K8S_43:The image reference is an input (gateway_image); production passes an @sha256 digest, which the variable validation accepts.
  metadata {
    name      = local.migrate_job_name
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.migrate
  }

  spec {
    backoff_limit           = 3
    active_deadline_seconds = 1800

    template {
      metadata {
        labels = local.labels.migrate
      }

      spec {
        restart_policy                  = "Never"
        service_account_name            = kubernetes_service_account_v1.beat.metadata[0].name # no AWS role needed
        automount_service_account_token = false
        node_selector                   = var.cpu_node_selector

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
          name              = "migrate"
          image             = var.gateway_image
          image_pull_policy = "Always"
          command           = ["mplex", "db", "upgrade"]

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
            requests = { cpu = "250m", memory = "512Mi", "ephemeral-storage" = "256Mi" }
            limits   = { cpu = "1", memory = "1Gi", "ephemeral-storage" = "1Gi" }
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
        }

        volume {
          name = "scratch"
          empty_dir {
            size_limit = "256Mi"
          }
        }
      }
    }
  }

  wait_for_completion = true

  timeouts {
    create = "30m"
    update = "30m"
  }
}
