variable "name" {
  description = "Deployment name: prefix of every AWS resource and the EKS cluster name."
  type        = string
  default     = "mplex-prod"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,24}$", var.name))
    error_message = "name must be 2-25 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "region" {
  description = "AWS region (pick one with p5 capacity, e.g. us-east-1, us-east-2, us-west-2)."
  type        = string
  default     = "us-east-1"
}

variable "availability_zones" {
  description = "Zones of the region to run in (at least 2, ideally 3). Choose zones that offer the GPU instance type: p5 capacity is not in every zone."
  type        = list(string)
  default     = ["us-east-1a", "us-east-1b", "us-east-1c"]
}

variable "api_allowed_cidrs" {
  description = "CIDRs that may reach the EKS API endpoint (the machine running Terraform, the operators' VPN). Required: the public endpoint is never open to 0.0.0.0/0."
  type        = list(string)

  validation {
    condition     = length(var.api_allowed_cidrs) > 0 && alltrue([for c in var.api_allowed_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "api_allowed_cidrs must list at least one valid CIDR and must not contain 0.0.0.0/0."
  }
}

variable "admin_principal_arns" {
  description = "IAM users/roles given cluster-admin on EKS, besides whoever runs the first apply."
  type        = list(string)
  default     = []
}

variable "adapter_bucket_name" {
  description = "Globally unique name of the adapter bucket (default: <name>-adapters-<account id>)."
  type        = string
  default     = null
}

variable "gateway_image" {
  description = "Gateway/worker image built from infra/docker/gateway.Dockerfile, with an explicit tag or (better) @sha256 digest."
  type        = string
}

variable "engine_image" {
  description = "Engine image built from infra/docker/engine.Dockerfile, with an explicit tag or (better) @sha256 digest."
  type        = string
}

variable "gateway_tls_certificate_arn" {
  description = "ACM certificate for the gateway's NLB listener (HTTPS on 443). Null serves plain HTTP on 80: only behind your own TLS terminator."
  type        = string
  default     = null
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node group (8x H100 80GB: p5.48xlarge)."
  type        = list(string)
  default     = ["p5.48xlarge"]
}

variable "gpu_nodes" {
  description = "Min, desired and max GPU nodes. Engines per node = GPUs per node (8 on p5.48xlarge)."
  type = object({
    min     = number
    desired = number
    max     = number
  })
  default = { min = 1, desired = 1, max = 4 }
}

variable "engines" {
  description = "Min and max engine replicas (engine_tensor_parallel_size GPUs each); max should not exceed the GPUs of gpu_nodes.max / engine_tensor_parallel_size."
  type = object({
    min = number
    max = number
  })
  default = { min = 2, max = 16 }
}

variable "engine_tensor_parallel_size" {
  description = "GPUs one engine spans (tensor parallelism, NCCL over NVLink inside one node): 1 for a base that fits one GPU, 2 or 4 for a 70B-class FP8 base on H100-80GB. Engines per node = 8 / this."
  type        = number
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8], var.engine_tensor_parallel_size)
    error_message = "engine_tensor_parallel_size must divide the 8 GPUs of a node: 1, 2, 4 or 8."
  }
}

variable "engine_extra_args" {
  description = "Extra `mplex engine serve` arguments: device, dtypes and KV budget per GPU (see docs/operations.md, Sizing)."
  type        = list(string)
  default     = ["--device", "cuda", "--dtype", "bfloat16", "--weight-dtype", "fp8", "--kv-memory-mb", "57344"]
}

variable "db_multi_az" {
  description = "Run PostgreSQL with a synchronous standby in a second AZ."
  type        = bool
  default     = true
}

variable "db_instance_class" {
  description = "RDS instance class of PostgreSQL."
  type        = string
  default     = "db.r7g.large"
}

variable "db_deletion_protection" {
  description = "Refuse to delete the database (turn off only to tear down a test environment)."
  type        = bool
  default     = true
}

variable "db_monitoring_interval" {
  description = "RDS enhanced monitoring interval in seconds (0 = off)."
  type        = number
  default     = 60
}

variable "redis_node_type" {
  description = "ElastiCache node type of Redis."
  type        = string
  default     = "cache.r7g.large"
}

variable "redis_multi_az" {
  description = "Run Redis with a replica in another AZ and automatic failover."
  type        = bool
  default     = true
}

variable "install_monitoring" {
  description = "Install Prometheus, Grafana (with infra/grafana/multiplex.json) and prometheus-adapter; the custom-metric autoscalers need it."
  type        = bool
  default     = true
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = { "mplex/owner" = "platform" }
}

variable "engine_tokens" {
  description = "MPLEX_ENGINE_TOKENS during a rotation: comma-separated, the one to send first (docs/operations.md). Null: the generated token."
  type        = string
  default     = null
  sensitive   = true
}
