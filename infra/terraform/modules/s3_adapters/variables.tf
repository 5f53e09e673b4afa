variable "bucket_name" {
  description = "Globally unique name of the adapter bucket (adapters by sha256, and base model weights under models/). The access-log bucket is named \"<bucket_name>-access-logs\"."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,48}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-50 lowercase letters, digits, dots or dashes (room is left for the -access-logs suffix)."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days before an overwritten or deleted object version is purged (the recovery window for a bad delete)."
  type        = number
  default     = 90

  validation {
    condition     = var.noncurrent_version_expiration_days >= 7
    error_message = "noncurrent_version_expiration_days must be at least 7."
  }
}

variable "access_log_retention_days" {
  description = "Days to keep S3 server access logs."
  type        = number
  default     = 365
}

variable "force_destroy" {
  description = "Allow destroying the buckets while they hold objects. Only for throw-away environments."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
