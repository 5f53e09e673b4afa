variable "name" {
  description = "EKS cluster name; also the prefix of its IAM roles, launch templates and log group."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}$", var.name))
    error_message = "name must be 2-39 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes minor version of the control plane and node groups, e.g. \"1.31\"."
  type        = string
  default     = "1.31"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.31."
  }
}

variable "private_subnet_ids" {
  description = "Private subnets for the control plane ENIs and every node group (at least two AZs)."
  type        = list(string)

  validation {
    condition     = length(var.private_subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two availability zones."
  }
}

variable "endpoint_public_access" {
  description = "Expose the Kubernetes API endpoint publicly (restricted to public_access_cidrs). Turn off when Terraform runs from inside the VPC (VPN, CI runner in the VPC)."
  type        = bool
  default     = true
}

variable "public_access_cidrs" {
  description = "CIDRs allowed to reach the public API endpoint, e.g. the operators' VPN egress. 0.0.0.0/0 is refused."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.public_access_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "public_access_cidrs must be valid CIDRs and must not contain 0.0.0.0/0."
  }
}

variable "admin_principal_arns" {
  description = "IAM principals (users or roles) granted cluster-admin through EKS access entries, besides the identity that creates the cluster."
  type        = list(string)
  default     = []
}

variable "cpu_node_group" {
  description = "CPU node group for gateways, Celery workers, beat and cluster add-ons."
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gb   = number
  })
  default = {
    instance_types = ["m7i.2xlarge", "m6i.2xlarge"]
    min_size       = 2
    max_size       = 10
    desired_size   = 3
    disk_size_gb   = 100
  }

  validation {
    condition     = var.cpu_node_group.min_size >= 1 && var.cpu_node_group.min_size <= var.cpu_node_group.desired_size && var.cpu_node_group.desired_size <= var.cpu_node_group.max_size
    error_message = "cpu_node_group needs 1 <= min_size <= desired_size <= max_size."
  }
}

variable "gpu_node_group" {
  description = "GPU node group for engines (one pod per GPU). Nodes carry the label mplex.ai/pool=gpu and the taint nvidia.com/gpu=true:NoSchedule, so only pods that tolerate it land there."
  type = object({
    instance_types = list(string)
    gpus_per_node  = number
    capacity_type  = string
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gb   = number
  })
  default = {
    instance_types = ["p5.48xlarge"] # 8x H100 80GB
    gpus_per_node  = 8
    capacity_type  = "ON_DEMAND"
    min_size       = 1
    max_size       = 4
    desired_size   = 1
    disk_size_gb   = 300 # the CUDA engine image is large; model weights live on per-pod volumes
  }

  validation {
    condition     = contains(["ON_DEMAND", "SPOT", "CAPACITY_BLOCK"], var.gpu_node_group.capacity_type)
    error_message = "gpu_node_group.capacity_type must be ON_DEMAND, SPOT or CAPACITY_BLOCK."
  }

  validation {
    condition     = var.gpu_node_group.min_size >= 0 && var.gpu_node_group.min_size <= var.gpu_node_group.desired_size && var.gpu_node_group.desired_size <= var.gpu_node_group.max_size && var.gpu_node_group.gpus_per_node >= 1
    error_message = "gpu_node_group needs 0 <= min_size <= desired_size <= max_size and gpus_per_node >= 1."
  }
}

variable "log_retention_days" {
  description = "CloudWatch retention of the control-plane logs, in days."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be one of the retention periods CloudWatch Logs accepts."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
