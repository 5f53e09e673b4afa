# Multiplex on AWS, end to end: network, EKS (CPU + H100 node groups), PostgreSQL, Redis, the adapter bucket,
# workload IAM roles, secrets, and the Kubernetes workloads. `terraform apply` with the variables in
# terraform.tfvars.example gives a running platform.

data "aws_caller_identity" "current" {}

locals {
  adapter_bucket = coalesce(var.adapter_bucket_name, "${var.name}-adapters-${data.aws_caller_identity.current.account_id}")
  namespace      = "mplex"
}

module "network" {
  source             = "../../modules/network"
  name               = var.name
  cluster_name       = var.name
  availability_zones = var.availability_zones
  tags               = var.tags
}

module "eks" {
  source               = "../../modules/eks"
  name                 = var.name
  private_subnet_ids   = module.network.private_subnet_ids
  public_access_cidrs  = var.api_allowed_cidrs
  admin_principal_arns = var.admin_principal_arns
  gpu_node_group = {
    instance_types = var.gpu_instance_types
    gpus_per_node  = 8
    capacity_type  = "ON_DEMAND"
    min_size       = var.gpu_nodes.min
    max_size       = var.gpu_nodes.max
    desired_size   = var.gpu_nodes.desired
    disk_size_gb   = 300
  }
  tags = var.tags
}

module "secrets" {
  source = "../../modules/secrets"
  name   = var.name
  tags   = var.tags
}

module "rds" {
  source                     = "../../modules/rds"
  name                       = var.name
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.eks.cluster_security_group_id]
  instance_class             = var.db_instance_class
  multi_az                   = var.db_multi_az
  deletion_protection        = var.db_deletion_protection
  monitoring_interval        = var.db_monitoring_interval
  password                   = module.secrets.database_password
  tags                       = var.tags
}

module "redis" {
  source                     = "../../modules/redis"
  name                       = var.name
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.eks.cluster_security_group_id]
  node_type                  = var.redis_node_type
  multi_az                   = var.redis_multi_az
  num_cache_clusters         = var.redis_multi_az ? 2 : 1
  auth_token                 = module.secrets.redis_auth_token
  tags                       = var.tags
}

module "adapters_bucket" {
  source      = "../../modules/s3_adapters"
  bucket_name = local.adapter_bucket
  tags        = var.tags
}

module "iam" {
  source             = "../../modules/iam"
  name               = var.name
  oidc_provider_arn  = module.eks.oidc_provider_arn
  oidc_provider_host = module.eks.oidc_provider_host
  namespace          = local.namespace
  bucket_arn         = module.adapters_bucket.bucket_arn
  bucket_kms_key_arn = module.adapters_bucket.kms_key_arn
  tags               = var.tags
}

module "app" {
  source = "../../modules/k8s_app"

  namespace         = local.namespace
  gateway_image     = var.gateway_image
  engine_image      = var.engine_image
  gpu_node_selector = module.eks.gpu_node_labels
  cpu_node_selector = module.eks.cpu_node_labels
  vpc_cidr          = module.network.vpc_cidr
  aws_region        = var.region
  cluster_name      = module.eks.cluster_name

  database = {
    host     = module.rds.address
    port     = module.rds.port
    name     = module.rds.database_name
    username = module.rds.username
  }
  database_password = module.secrets.database_password
  redis             = { host = module.redis.primary_endpoint, port = module.redis.port }
  redis_auth_token  = module.secrets.redis_auth_token
  secret_key        = module.secrets.secret_key
  engine_tokens     = coalesce(var.engine_tokens, module.secrets.engine_token)
  storage_bucket    = module.adapters_bucket.bucket_name

  engine_role_arn             = module.iam.engine_role_arn
  worker_role_arn             = module.iam.worker_role_arn
  cluster_autoscaler_role_arn = module.eks.cluster_autoscaler_role_arn

  gateway = { tls_certificate_arn = var.gateway_tls_certificate_arn }
  engine = {
    min_replicas         = var.engines.min
    max_replicas         = var.engines.max
    extra_args           = var.engine_extra_args
    tensor_parallel_size = var.engine_tensor_parallel_size
  }

  install_monitoring = var.install_monitoring
  dashboards         = { "multiplex.json" = file("${path.module}/../../../grafana/multiplex.json") }

  # Volumes, DNS and node registration must exist before the first pod is scheduled.
  depends_on = [module.eks]
}
