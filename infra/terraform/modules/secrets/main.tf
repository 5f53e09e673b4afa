# The four secrets Multiplex runs on, generated here and kept in Secrets Manager under one KMS key:
# the PostgreSQL password, the Redis AUTH token, MPLEX_SECRET_KEY (signs sessions, salts prefix-cache keys) and
# the engine token (MPLEX_ENGINE_TOKENS: the platform credential every engine endpoint but the probes requires).
# RDS and ElastiCache are created with the same values; pods receive them through a Kubernetes Secret.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  tags = merge(var.tags, { "mplex/module" = "secrets" })
}

resource "aws_kms_key" "secrets" {
  description         = "${var.name} Secrets Manager secrets"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.secrets_key.json
  tags                = local.tags
}

resource "aws_kms_alias" "secrets" {
  name          = "alias/${var.name}-secrets"
  target_key_id = aws_kms_key.secrets.key_id
}

data "aws_iam_policy_document" "secrets_key" {
  #checkov:skip=CKV_AWS_109:A KMS key policy's resource "*" means this key only; the account root must keep admin or the key becomes unmanageable.
  #checkov:skip=CKV_AWS_111:Same: key policies are scoped to their key, the account root administers it.
  #checkov:skip=CKV_AWS_356:Same: "*" in a key policy is the key itself.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }

  dynamic "statement" {
    for_each = length(var.reader_role_arns) > 0 ? [1] : []
    content {
      sid       = "ReadersDecryptThroughSecretsManager"
      actions   = ["kms:Decrypt", "kms:DescribeKey"]
      resources = ["*"]
      principals {
        type        = "AWS"
        identifiers = var.reader_role_arns
      }
      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["secretsmanager.${data.aws_region.current.name}.${data.aws_partition.current.dns_suffix}"]
      }
    }
  }
}

# RDS refuses '/', '@', '"' and spaces in passwords; URL-unreserved specials keep the DSN free of escaping.
resource "random_password" "database" {
  length           = 40
  special          = true
  override_special = "-_.~"
}

resource "random_password" "redis" {
  length  = 64
  special = false
}

resource "random_password" "secret_key" {
  length  = 64
  special = false
}

resource "random_password" "engine_token" {
  length  = 64
  special = false # one entry of a comma-separated list: no separators inside
}

# Descriptions and values apart: for_each keys must not be derived from sensitive values.
locals {
  secret_descriptions = {
    "database-password" = "PostgreSQL master password of ${var.name}"
    "redis-auth-token"  = "ElastiCache AUTH token of ${var.name}"
    "secret-key"        = "MPLEX_SECRET_KEY of ${var.name}"
    "engine-token"      = "Engine platform credential (MPLEX_ENGINE_TOKENS) of ${var.name}"
  }
  secret_values = {
    "database-password" = random_password.database.result
    "redis-auth-token"  = random_password.redis.result
    "secret-key"        = random_password.secret_key.result
    "engine-token"      = random_password.engine_token.result
  }
}

resource "aws_secretsmanager_secret" "this" {
  #checkov:skip=CKV2_AWS_57:Rotation must restart every pod holding the value and, for Redis, use the two-token ROTATE strategy; it is an operator procedure (docs/operations.md), not a Lambda.
  for_each                = local.secret_descriptions
  name                    = "${var.name}/${each.key}"
  description             = each.value
  kms_key_id              = aws_kms_key.secrets.arn
  recovery_window_in_days = var.recovery_window_days
  tags                    = local.tags
}

resource "aws_secretsmanager_secret_version" "this" {
  for_each      = local.secret_descriptions
  secret_id     = aws_secretsmanager_secret.this[each.key].id
  secret_string = local.secret_values[each.key]
}
