# PostgreSQL for tenants, keys, adapters and the usage ledger: private, KMS-encrypted, TLS-only, backed up,
# optionally multi-AZ, with IAM database authentication available for humans.

data "aws_caller_identity" "current" {}

data "aws_region" "current" {}

data "aws_partition" "current" {}

locals {
  partition     = data.aws_partition.current.partition
  account       = data.aws_caller_identity.current.account_id
  region        = data.aws_region.current.name
  major_version = split(".", var.engine_version)[0]
  tags          = merge(var.tags, { "mplex/module" = "rds" })
}

resource "aws_kms_key" "db" {
  description         = "${var.name} PostgreSQL storage, snapshots, Performance Insights and logs"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.db_key.json
  tags                = local.tags
}

resource "aws_kms_alias" "db" {
  name          = "alias/${var.name}-rds"
  target_key_id = aws_kms_key.db.key_id
}

data "aws_iam_policy_document" "db_key" {
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
      values   = ["arn:${local.partition}:logs:${local.region}:${local.account}:log-group:/aws/rds/instance/${var.name}/*"]
    }
  }
}

resource "aws_db_subnet_group" "this" {
  name       = var.name
  subnet_ids = var.subnet_ids
  tags       = local.tags
}

resource "aws_security_group" "db" {
  name        = "${var.name}-postgres"
  description = "PostgreSQL reachable from the EKS cluster only"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-postgres" })
}

# count, not for_each: the group IDs are usually created in the same apply, and for_each keys must be known at plan.
resource "aws_vpc_security_group_ingress_rule" "db" {
  count                        = length(var.allowed_security_group_ids)
  security_group_id            = aws_security_group.db.id
  description                  = "PostgreSQL from the allowed security group ${count.index}"
  ip_protocol                  = "tcp"
  from_port                    = 5432
  to_port                      = 5432
  referenced_security_group_id = var.allowed_security_group_ids[count.index]
}

resource "aws_db_parameter_group" "this" {
  name_prefix = "${var.name}-pg${local.major_version}-"
  family      = "postgres${local.major_version}"
  description = "Multiplex PostgreSQL ${local.major_version}: TLS only, statement logging"
  tags        = local.tags

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }

  # DDL is rare and worth an audit trail; everything slower than a second is a bug to look at.
  parameter {
    name  = "log_statement"
    value = "ddl"
  }

  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }

  parameter {
    name  = "log_lock_waits"
    value = "1"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_cloudwatch_log_group" "postgres" {
  for_each          = toset(["postgresql", "upgrade"])
  name              = "/aws/rds/instance/${var.name}/${each.value}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.db.arn
  tags              = local.tags
}

data "aws_iam_policy_document" "monitoring_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "monitoring" {
  count              = var.monitoring_interval > 0 ? 1 : 0
  name               = "${var.name}-rds-monitoring"
  assume_role_policy = data.aws_iam_policy_document.monitoring_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy_attachment" "monitoring" {
  count      = var.monitoring_interval > 0 ? 1 : 0
  role       = aws_iam_role.monitoring[0].name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "this" {
  #checkov:skip=CKV_AWS_118:Enhanced monitoring is on by default (monitoring_interval=60); the variable lets a cost-sensitive environment turn it off.
  identifier     = var.name
  engine         = "postgres"
  engine_version = var.engine_version
  instance_class = var.instance_class

  db_name  = var.database_name
  username = var.username
  password = var.password
  port     = 5432

  allocated_storage     = var.allocated_storage_gb
  max_allocated_storage = var.max_allocated_storage_gb
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.db.arn

  db_subnet_group_name                = aws_db_subnet_group.this.name
  vpc_security_group_ids              = [aws_security_group.db.id]
  publicly_accessible                 = false
  multi_az                            = var.multi_az
  parameter_group_name                = aws_db_parameter_group.this.name
  iam_database_authentication_enabled = true

  backup_retention_period   = var.backup_retention_days
  backup_window             = "03:00-04:00"
  maintenance_window        = "sun:04:30-sun:05:30"
  copy_tags_to_snapshot     = true
  delete_automated_backups  = false
  deletion_protection       = var.deletion_protection
  skip_final_snapshot       = var.skip_final_snapshot
  final_snapshot_identifier = var.skip_final_snapshot ? null : "${var.name}-final"

  auto_minor_version_upgrade  = true
  allow_major_version_upgrade = false

  monitoring_interval = var.monitoring_interval
  monitoring_role_arn = var.monitoring_interval > 0 ? aws_iam_role.monitoring[0].arn : null

  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.db.arn
  performance_insights_retention_period = var.performance_insights_retention_days

  enabled_cloudwatch_logs_exports = ["postgresql", "upgrade"]

  tags = local.tags

  depends_on = [aws_cloudwatch_log_group.postgres]
}
