# --- placement and images -------------------------------------------------------------------------------------

variable "namespace" {
  description = "Namespace for every Multiplex workload (must match the IRSA trust policies)."
  type        = string
  default     = "mplex"
}

variable "gateway_image" {
  description = "Image for gateway, workers, beat and migrations (infra/docker/gateway.Dockerfile), e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/mplex-gateway@sha256:<digest>. Pin by digest in production."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.gateway_image))
    error_message = "gateway_image must be registry/repository with an explicit :tag or @sha256:digest (never an implicit latest)."
  }
}

variable "engine_image" {
  description = "CUDA image for engines and GPU eval workers (infra/docker/engine.Dockerfile). Pin by digest in production."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?/[a-z0-9._/-]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$", var.engine_image))
    error_message = "engine_image must be registry/repository with an explicit :tag or @sha256:digest (never an implicit latest)."
  }
}

variable "model_sync_image" {
  description = "AWS CLI image of the init container that syncs base-model weights from S3 onto the engine's volume."
  type        = string
  default     = "public.ecr.aws/aws-cli/aws-cli:2.22.35"
}

variable "gpu_node_selector" {
  description = "Labels selecting GPU nodes (the eks module's gpu_node_labels)."
  type        = map(string)
  default     = { "mplex.ai/pool" = "gpu" }
}

variable "cpu_node_selector" {
  description = "Labels selecting CPU nodes (the eks module's cpu_node_labels)."
  type        = map(string)
  default     = { "mplex.ai/pool" = "cpu" }
}

variable "vpc_cidr" {
  description = "VPC CIDR: egress to PostgreSQL and Redis, and kubelet health probes from nodes, are allowed from/to it."
  type        = string

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be a valid CIDR."
  }
}

# --- dependencies ---------------------------------------------------------------------------------------------

variable "database" {
  description = "PostgreSQL connection (the rds module's outputs). sslmode verify-full checks the server against the RDS CA bundle baked into the images."
  type = object({
    host     = string
    port     = number
    name     = string
    username = string
    sslmode  = optional(string, "verify-full")
  })

  validation {
    condition     = contains(["require", "verify-ca", "verify-full"], var.database.sslmode)
    error_message = "database.sslmode must be require, verify-ca or verify-full: RDS forces TLS."
  }
}

variable "database_password" {
  description = "PostgreSQL password (the secrets module's database_password)."
  type        = string
  sensitive   = true
}

variable "redis" {
  description = "Redis connection (the redis module's outputs). Quotas and registry use db 0, the Celery broker db 1."
  type = object({
    host = string
    port = number
  })
}

variable "redis_auth_token" {
  description = "Redis AUTH token (the secrets module's redis_auth_token)."
  type        = string
  sensitive   = true
}

variable "secret_key" {
  description = "MPLEX_SECRET_KEY (the secrets module's secret_key)."
  type        = string
  sensitive   = true
}

variable "engine_tokens" {
  description = "MPLEX_ENGINE_TOKENS: the engine tokens accepted, comma-separated, the one clients send first (rotation: docs/operations.md)."
  type        = string
  sensitive   = true

  validation {
    condition     = alltrue([for t in split(",", var.engine_tokens) : length(trimspace(t)) >= 32])
    error_message = "engine_tokens must be a comma-separated list of tokens of at least 32 characters each."
  }
}

variable "storage_bucket" {
  description = "Adapter bucket name; MPLEX_STORAGE_URL becomes s3://<bucket>/<storage_prefix>."
  type        = string
}

variable "storage_prefix" {
  description = "Key prefix of adapter objects inside the bucket."
  type        = string
  default     = "adapters"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9/_-]*[a-z0-9]$", var.storage_prefix))
    error_message = "storage_prefix must be a relative key prefix without leading or trailing slashes."
  }
}

variable "base_model_prefix" {
  description = "Key prefix in the same bucket holding the base model checkpoint (Hugging Face safetensors directory) that engines serve from /models/base."
  type        = string
  default     = "models/base"
}

variable "aws_region" {
  description = "AWS region, for the SDKs in the pods."
  type        = string
}

variable "engine_role_arn" {
  description = "IRSA role of the engine service account (the iam module's engine_role_arn)."
  type        = string
}

variable "worker_role_arn" {
  description = "IRSA role of the worker service account (the iam module's worker_role_arn)."
  type        = string
}

# --- gateway --------------------------------------------------------------------------------------------------

variable "gateway" {
  description = "Gateway sizing and autoscaling: HPA on CPU utilisation and on requests/s per pod (the latter needs the Prometheus stack)."
  type = object({
    min_replicas                = optional(number, 3)
    max_replicas                = optional(number, 30)
    target_cpu_utilization      = optional(number, 65)
    target_requests_per_second  = optional(number, 200)
    cpu                         = optional(string, "2")
    memory                      = optional(string, "4Gi")
    service_type                = optional(string, "LoadBalancer")
    internal_load_balancer      = optional(bool, false)
    tls_certificate_arn         = optional(string)
    load_balancer_source_ranges = optional(list(string), [])
  })
  default = {}

  validation {
    condition     = var.gateway.min_replicas >= 2 && var.gateway.min_replicas <= var.gateway.max_replicas
    error_message = "gateway needs 2 <= min_replicas <= max_replicas (one gateway is a single point of failure)."
  }

  validation {
    condition     = contains(["LoadBalancer", "ClusterIP"], var.gateway.service_type)
    error_message = "gateway.service_type must be LoadBalancer or ClusterIP (behind your own ingress)."
  }
}

# --- engines --------------------------------------------------------------------------------------------------

variable "engine" {
  description = "Engine StatefulSet: one pod per engine, holding tensor_parallel_size GPUs of one node (one rank per GPU, NCCL between them; cpu and memory are the whole pod's). HPA on waiting requests and KV occupancy per engine (needs the Prometheus stack); max_replicas is bounded by the GPU node group's GPUs / tensor_parallel_size. node_selector is merged over gpu_node_selector (e.g. a GPU product label, so TP ranks share NVLink); nccl_env is merged over the NCCL defaults in engine.tf."
  type = object({
    min_replicas                     = optional(number, 2)
    max_replicas                     = optional(number, 8)
    target_waiting_requests          = optional(number, 8)
    target_kv_occupancy              = optional(number, 0.85)
    served_model_name                = optional(string, "base")
    extra_args                       = optional(list(string), ["--device", "cuda", "--dtype", "bfloat16", "--weight-dtype", "fp8", "--kv-memory-mb", "57344"])
    cpu                              = optional(string, "20")
    memory                           = optional(string, "200Gi")
    model_volume_size                = optional(string, "300Gi")
    termination_grace_period_seconds = optional(number, 600)
    tensor_parallel_size             = optional(number, 1)
    node_selector                    = optional(map(string), {})
    nccl_env                         = optional(map(string), {})
  })
  default = {}

  validation {
    condition     = var.engine.min_replicas >= 1 && var.engine.min_replicas <= var.engine.max_replicas
    error_message = "engine needs 1 <= min_replicas <= max_replicas."
  }

  validation {
    condition     = var.engine.termination_grace_period_seconds >= 60
    error_message = "engine.termination_grace_period_seconds must be at least 60: streams in flight need time to finish."
  }

  validation {
    condition     = contains([1, 2, 4, 8], var.engine.tensor_parallel_size)
    error_message = "engine.tensor_parallel_size must be 1, 2, 4 or 8 (the GPUs of one node a single engine spans; it must divide the model's attention heads, KV heads and MLP size)."
  }

  validation {
    condition     = var.engine.target_kv_occupancy > 0 && var.engine.target_kv_occupancy < 1
    error_message = "engine.target_kv_occupancy must be a fraction between 0 and 1."
  }
}

# --- workers and beat -----------------------------------------------------------------------------------------

variable "workers" {
  description = "One Celery worker Deployment per entry (key = short name). gpu = true runs it from the engine image on a GPU (the adapter quality gate serves the adapter on the production base). HPA on the queue's depth per replica (needs the Prometheus stack)."
  type = map(object({
    queue                  = string
    min_replicas           = number
    max_replicas           = number
    target_depth_per_pod   = number
    gpu                    = optional(bool, false)
    cpu                    = optional(string, "1")
    memory                 = optional(string, "2Gi")
    scratch_volume_size    = optional(string, "300Gi")
    termination_grace_secs = optional(number, 300)
  }))
  default = {
    ingest  = { queue = "adapters.ingest", min_replicas = 1, max_replicas = 6, target_depth_per_pod = 5, cpu = "2", memory = "8Gi" }
    eval    = { queue = "adapters.eval", min_replicas = 1, max_replicas = 4, target_depth_per_pod = 2, gpu = true, cpu = "16", memory = "180Gi", termination_grace_secs = 1800 }
    billing = { queue = "billing", min_replicas = 1, max_replicas = 3, target_depth_per_pod = 20 }
    # One batch per worker process for its whole run: scale on batches waiting, not on tokens.
    batches = { queue = "batches", min_replicas = 1, max_replicas = 4, target_depth_per_pod = 1 }
  }

  validation {
    condition     = alltrue([for k, w in var.workers : can(regex("^[a-z][a-z0-9-]{0,20}$", k)) && w.min_replicas >= 1 && w.min_replicas <= w.max_replicas && w.target_depth_per_pod > 0])
    error_message = "workers: keys must be short DNS labels, and each needs 1 <= min_replicas <= max_replicas and target_depth_per_pod > 0."
  }

  validation {
    condition     = length(setsubtract(toset(["adapters.ingest", "adapters.eval", "billing", "batches"]), toset([for w in values(var.workers) : w.queue]))) == 0
    error_message = "workers must consume every queue: adapters.ingest, adapters.eval, billing and batches."
  }
}

variable "beat_resources" {
  description = "CPU and memory of the single Celery beat pod."
  type = object({
    cpu    = string
    memory = string
  })
  default = { cpu = "250m", memory = "512Mi" }
}

# --- cluster add-ons ------------------------------------------------------------------------------------------

variable "install_nvidia_device_plugin" {
  description = "Install the NVIDIA device plugin DaemonSet that advertises nvidia.com/gpu on GPU nodes."
  type        = bool
  default     = true
}

variable "install_metrics_server" {
  description = "Install metrics-server (CPU metrics for the gateway HPA). Turn off if the cluster already has it."
  type        = bool
  default     = true
}

variable "install_monitoring" {
  description = "Install kube-prometheus-stack (Prometheus, Grafana with the Multiplex dashboard) and prometheus-adapter (custom metrics for the requests/queue-depth/KV autoscalers). Without it, only the gateway's CPU autoscaler exists."
  type        = bool
  default     = true
}

variable "install_cluster_autoscaler" {
  description = "Install the cluster autoscaler so pending engine pods add GPU nodes."
  type        = bool
  default     = true
}

variable "cluster_name" {
  description = "EKS cluster name (the cluster autoscaler discovers node groups by it)."
  type        = string
}

variable "cluster_autoscaler_role_arn" {
  description = "IRSA role of the cluster autoscaler (the eks module's cluster_autoscaler_role_arn)."
  type        = string
  default     = null
}

variable "chart_versions" {
  description = "Pinned Helm chart versions of the add-ons."
  type = object({
    nvidia_device_plugin  = optional(string, "0.17.0")
    metrics_server        = optional(string, "3.12.2")
    cluster_autoscaler    = optional(string, "9.43.2")
    kube_prometheus_stack = optional(string, "66.3.1")
    prometheus_adapter    = optional(string, "4.11.0")
  })
  default = {}
}

variable "dashboards" {
  description = "Grafana dashboards to provision, file name => JSON (pass file(\"infra/grafana/multiplex.json\"))."
  type        = map(string)
  default     = {}
}

variable "monitoring_namespace" {
  description = "Namespace of Prometheus, Grafana and prometheus-adapter; its pods may scrape the Multiplex metrics ports."
  type        = string
  default     = "monitoring"
}

variable "prometheus_retention" {
  description = "How long Prometheus keeps samples."
  type        = string
  default     = "15d"
}
