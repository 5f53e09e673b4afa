variable "name" {
  description = "Identifier of the DB instance; prefix of its subnet group, parameter group, security group and KMS alias."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,50}$", var.name))
    error_message = "name must be 2-51 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC of the database."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the DB subnet group (at least two AZs)."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "A DB subnet group needs subnets in at least two availability zones."
  }
}

variable "allowed_security_group_ids" {
  description = "Security groups allowed to connect on 5432 (the EKS cluster security group)."
  type        = list(string)
}

variable "engine_version" {
  description = "PostgreSQL engine version."
  type        = string
  default     = "16.4"

  validation {
    condition     = can(regex("^1[4-9](\\.[0-9]+)?$", var.engine_version))
    error_message = "engine_version must be PostgreSQL 14 or newer, e.g. 16.4."
  }
}

variable "instance_class" {
  description = "DB instance class."
  type        = string
  default     = "db.r7g.large"
}

variable "allocated_storage_gb" {
  description = "Initial gp3 storage, in GB."
  type        = number
  default     = 100

  validation {
    condition     = var.allocated_storage_gb >= 20
    error_message = "allocated_storage_gb must be at least 20."
  }
}

variable "max_allocated_storage_gb" {
  description = "Ceiling for storage autoscaling, in GB (the usage ledger grows without bound until rolled up)."
  type        = number
  default     = 1000
}

variable "multi_az" {
  description = "Run a synchronous standby in another AZ with automatic failover."
  type        = bool
  default     = true
}

variable "backup_retention_days" {
  description = "Days of automated backups and point-in-time recovery (7-35: the ledger is money)."
  type        = number
  default     = 14

  validation {
    condition     = var.backup_retention_days >= 7 && var.backup_retention_days <= 35
    error_message = "backup_retention_days must be between 7 and 35."
  }
}

variable "deletion_protection" {
  description = "Refuse to delete the instance until this is turned off."
  type        = bool
  default     = true
}

variable "skip_final_snapshot" {
  description = "Skip the final snapshot on destroy. Only for throw-away environments."
  type        = bool
  default     = false
}

variable "monitoring_interval" {
  description = "Enhanced monitoring interval in seconds; 0 turns enhanced monitoring off."
  type        = number
  default     = 60

  validation {
    condition     = contains([0, 1, 5, 10, 15, 30, 60], var.monitoring_interval)
    error_message = "monitoring_interval must be one of 0, 1, 5, 10, 15, 30, 60."
  }
}

variable "performance_insights_retention_days" {
  description = "Performance Insights retention: 7 (free tier) or a multiple of 31 up to 731."
  type        = number
  default     = 7

  validation {
    condition     = var.performance_insights_retention_days == 7 || (var.performance_insights_retention_days % 31 == 0 && var.performance_insights_retention_days <= 731) || var.performance_insights_retention_days == 731
    error_message = "performance_insights_retention_days must be 7, a multiple of 31, or 731."
  }
}

variable "database_name" {
  description = "Name of the application database."
  type        = string
  default     = "mplex"
}

variable "username" {
  description = "Master user name; the application and its migrations use it."
  type        = string
  default     = "mplex"
}

variable "password" {
  description = "Master password (from the secrets module; also stored in Secrets Manager)."
  type        = string
  sensitive   = true

  validation {
    condition     = length(var.password) >= 16
    error_message = "password must be at least 16 characters."
  }
}

variable "log_retention_days" {
  description = "CloudWatch retention of the exported PostgreSQL logs, in days."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
