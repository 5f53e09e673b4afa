variable "name" {
  description = "Replication group ID; prefix of its subnet group, parameter group, security group and KMS alias."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,39}$", var.name))
    error_message = "name must be 2-40 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC of the cache."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the cache subnet group."
  type        = list(string)
}

variable "allowed_security_group_ids" {
  description = "Security groups allowed to connect on 6379 (the EKS cluster security group)."
  type        = list(string)
}

variable "engine_version" {
  description = "Redis OSS engine version."
  type        = string
  default     = "7.1"

  validation {
    condition     = can(regex("^7\\.[0-9]+$", var.engine_version))
    error_message = "engine_version must be a Redis 7.x version (the quota Lua scripts need 7)."
  }
}

variable "node_type" {
  description = "Cache node type."
  type        = string
  default     = "cache.r7g.large"
}

variable "num_cache_clusters" {
  description = "Nodes in the replication group: one primary plus replicas. Multi-AZ failover needs at least 2."
  type        = number
  default     = 2

  validation {
    condition     = var.num_cache_clusters >= 1 && var.num_cache_clusters <= 6
    error_message = "num_cache_clusters must be between 1 and 6."
  }
}

variable "multi_az" {
  description = "Place replicas in other AZs and fail over automatically (requires num_cache_clusters >= 2)."
  type        = bool
  default     = true
}

variable "auth_token" {
  description = "Redis AUTH token (from the secrets module; also stored in Secrets Manager). 16-128 printable characters."
  type        = string
  sensitive   = true

  validation {
    condition     = length(var.auth_token) >= 16 && length(var.auth_token) <= 128 && !can(regex("[@\"/ ]", var.auth_token))
    error_message = "auth_token must be 16-128 characters without @, \", / or spaces."
  }
}

variable "snapshot_retention_days" {
  description = "Days of daily snapshots to keep (quota windows and the Celery broker are rebuilt on loss, but a snapshot shortens recovery)."
  type        = number
  default     = 7

  validation {
    condition     = var.snapshot_retention_days >= 1 && var.snapshot_retention_days <= 35
    error_message = "snapshot_retention_days must be between 1 and 35."
  }
}

variable "log_retention_days" {
  description = "CloudWatch retention of the slow and engine logs, in days."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
