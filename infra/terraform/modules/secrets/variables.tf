variable "name" {
  description = "Prefix of the secret names (\"<name>/database-password\", ...) and of the KMS alias."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,40}$", var.name))
    error_message = "name must be 2-41 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "recovery_window_days" {
  description = "Days a deleted secret can still be restored (0 deletes at once; only for throw-away environments)."
  type        = number
  default     = 7

  validation {
    condition     = var.recovery_window_days == 0 || (var.recovery_window_days >= 7 && var.recovery_window_days <= 30)
    error_message = "recovery_window_days must be 0 or between 7 and 30."
  }
}

variable "reader_role_arns" {
  description = "Extra IAM roles allowed to read the secrets through the KMS key (e.g. a CI deploy role). The account root always administers the key."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
