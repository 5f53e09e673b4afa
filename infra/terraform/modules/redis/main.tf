# ElastiCache Redis for quotas, the key cache, the engine registry and the Celery broker: TLS in transit,
# KMS at rest, AUTH token, multi-AZ failover.

data "aws_caller_identity" "current" {}

data "aws_region" "current" {}

data "aws_partition" "current" {}

locals {
  partition = data.aws_partition.current.partition
  account   = data.aws_caller_identity.current.account_id
  region    = data.aws_region.current.name
  tags      = merge(var.tags, { "mplex/module" = "redis" })
}

resource "aws_kms_key" "redis" {
  description         = "${var.name} ElastiCache at-rest encryption and logs"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.redis_key.json
  tags                = local.tags
}

resource "aws_kms_alias" "redis" {
  name          = "alias/${var.name}-redis"
  target_key_id = aws_kms_key.redis.key_id
}

data "aws_iam_policy_document" "redis_key" {
  #checkov:skip=CKV_AWS_109:A KMS key policy's resource "*" means this key only; the account root must keep admin or the key becomes unmanageable.
  #checkov:skip=CKV_AWS_111:Same: key policies are scoped to their key, the account root administers it.
  #checkov:skip=CKV_AWS_356:Same: "*" in a key policy is the key itself.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account}:root"]
    }
  }

  statement {
    sid       = "CloudWatchLogsEncrypts"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${local.region}:${local.account}:log-group:/aws/elasticache/${var.name}/*"]
    }
  }
}

resource "aws_elasticache_subnet_group" "this" {
  name       = var.name
  subnet_ids = var.subnet_ids
  tags       = local.tags
}

resource "aws_security_group" "redis" {
  name        = "${var.name}-redis"
  description = "Redis reachable from the EKS cluster only"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-redis" })
}

# count, not for_each: the group IDs are usually created in the same apply, and for_each keys must be known at plan.
resource "aws_vpc_security_group_ingress_rule" "redis" {
  count                        = length(var.allowed_security_group_ids)
  security_group_id            = aws_security_group.redis.id
  description                  = "Redis from the allowed security group ${count.index}"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = var.allowed_security_group_ids[count.index]
}

resource "aws_elasticache_parameter_group" "this" {
  name   = "${var.name}-redis7"
  family = "redis7"
  tags   = local.tags

  # Quota windows and queued Celery tasks must never be evicted to make room: fail writes loudly instead.
  parameter {
    name  = "maxmemory-policy"
    value = "noeviction"
  }
}

resource "aws_cloudwatch_log_group" "redis" {
  for_each          = toset(["slow-log", "engine-log"])
  name              = "/aws/elasticache/${var.name}/${each.value}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.redis.arn
  tags              = local.tags
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id = var.name
  description          = "Multiplex quotas, registry, key cache and Celery broker"
  engine               = "redis"
  engine_version       = var.engine_version
  node_type            = var.node_type
  port                 = 6379
  num_cache_clusters   = var.num_cache_clusters
  parameter_group_name = aws_elasticache_parameter_group.this.name
  subnet_group_name    = aws_elasticache_subnet_group.this.name
  security_group_ids   = [aws_security_group.redis.id]

  automatic_failover_enabled = var.multi_az
  multi_az_enabled           = var.multi_az

  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.redis.arn
  transit_encryption_enabled = true
  transit_encryption_mode    = "required"
  auth_token                 = var.auth_token
  auth_token_update_strategy = "ROTATE"

  snapshot_retention_limit   = var.snapshot_retention_days
  snapshot_window            = "02:00-03:00"
  maintenance_window         = "sun:05:30-sun:06:30"
  auto_minor_version_upgrade = true
  apply_immediately          = false

  dynamic "log_delivery_configuration" {
    for_each = aws_cloudwatch_log_group.redis
    content {
      destination      = log_delivery_configuration.value.name
      destination_type = "cloudwatch-logs"
      log_format       = "json"
      log_type         = log_delivery_configuration.key
    }
  }

  tags = local.tags

  lifecycle {
    precondition {
      condition     = !var.multi_az || var.num_cache_clusters >= 2
      error_message = "multi_az needs num_cache_clusters >= 2 (a primary and at least one replica)."
    }
  }
}
