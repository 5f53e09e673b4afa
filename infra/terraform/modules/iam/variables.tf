variable "name" {
  description = "Prefix of the IAM role names."
  type        = string
}

variable "oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider."
  type        = string
}

variable "oidc_provider_host" {
  description = "Issuer host/path of that provider, without https:// (prefix of the :sub and :aud condition keys)."
  type        = string

  validation {
    condition     = !startswith(var.oidc_provider_host, "https://")
    error_message = "oidc_provider_host must not include the https:// scheme."
  }
}

variable "namespace" {
  description = "Kubernetes namespace of the Multiplex service accounts."
  type        = string
  default     = "mplex"
}

variable "engine_service_account" {
  description = "Service account of the engine pods (reads adapters and model weights)."
  type        = string
  default     = "mplex-engine"
}

variable "worker_service_account" {
  description = "Service account of the Celery worker pods (the only writer of adapter objects)."
  type        = string
  default     = "mplex-worker"
}

variable "bucket_arn" {
  description = "ARN of the adapter bucket."
  type        = string
}

variable "bucket_kms_key_arn" {
  description = "ARN of the KMS key the adapter bucket encrypts with."
  type        = string
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
