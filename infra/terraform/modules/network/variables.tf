variable "name" {
  description = "Name prefix for every resource (also the Name tag)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "cidr" {
  description = "VPC CIDR. Private subnets get a /19-equivalent slice each (EKS pods take VPC addresses through the VPC CNI), public ones a small slice for NAT and load balancers."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.cidr, 0)) && tonumber(split("/", var.cidr)[1]) >= 12 && tonumber(split("/", var.cidr)[1]) <= 16
    error_message = "cidr must be a valid IPv4 CIDR between /12 and /16."
  }
}

variable "availability_zones" {
  description = "Availability zones to spread subnets over, by name (e.g. [\"us-east-1a\", \"us-east-1b\", \"us-east-1c\"]). Named explicitly so a zone AWS adds later never reshuffles the subnets; pick zones with capacity for the GPU instance type. RDS and ElastiCache multi-AZ need at least 2."
  type        = list(string)

  validation {
    condition     = length(var.availability_zones) >= 2 && length(var.availability_zones) <= 6 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "availability_zones must name 2 to 6 distinct zones."
  }
}

variable "single_nat_gateway" {
  description = "One shared NAT gateway instead of one per AZ: cheaper, but an AZ outage then cuts egress for every AZ."
  type        = bool
  default     = false
}

variable "cluster_name" {
  description = "EKS cluster name, used in the subnet discovery tags the AWS load balancer integrations read."
  type        = string
}

variable "flow_log_retention_days" {
  description = "CloudWatch retention of the VPC flow logs, in days."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days must be one of the retention periods CloudWatch Logs accepts."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
