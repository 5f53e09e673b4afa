# The adapter bucket: SSE-KMS with a bucket key, versioned, never public, TLS-only, access-logged.
# Adapter files are content-addressed and immutable; versioning is the undo for a mistaken delete.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

locals {
  partition       = data.aws_partition.current.partition
  account         = data.aws_caller_identity.current.account_id
  log_bucket_name = "${var.bucket_name}-access-logs"
  tags            = merge(var.tags, { "mplex/module" = "s3_adapters" })
}

resource "aws_kms_key" "bucket" {
  description         = "${var.bucket_name} adapter and model objects"
  enable_key_rotation = true
  policy              = data.aws_iam_policy_document.bucket_key.json
  tags                = local.tags
}

resource "aws_kms_alias" "bucket" {
  name          = "alias/${var.bucket_name}"
  target_key_id = aws_kms_key.bucket.key_id
}

# Only the account administers the key; workloads get kms:Decrypt / GenerateDataKey through their IAM roles.
data "aws_iam_policy_document" "bucket_key" {
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
}

resource "aws_s3_bucket" "adapters" {
  #checkov:skip=CKV_AWS_144:Cross-region replication is a disaster-recovery choice per deployment; adapters are re-uploadable and versioned here, the source of truth for which exist is Postgres.
  #checkov:skip=CKV2_AWS_62:Nothing reacts to bucket events: ingest is driven by the API and Celery, never by object notifications.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_ownership_controls" "adapters" {
  bucket = aws_s3_bucket.adapters.id
  rule {
    object_ownership = "BucketOwnerEnforced" # no ACLs at all
  }
}

resource "aws_s3_bucket_public_access_block" "adapters" {
  bucket                  = aws_s3_bucket.adapters.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "adapters" {
  bucket = aws_s3_bucket.adapters.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "adapters" {
  bucket = aws_s3_bucket.adapters.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.bucket.arn
    }
    bucket_key_enabled = true # one KMS call per object read instead of per request: model weights are read in parts
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "adapters" {
  bucket = aws_s3_bucket.adapters.id

  rule {
    id     = "expire-old-versions"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 2
    }
  }

  depends_on = [aws_s3_bucket_versioning.adapters]
}

resource "aws_s3_bucket_logging" "adapters" {
  bucket        = aws_s3_bucket.adapters.id
  target_bucket = aws_s3_bucket.logs.id
  target_prefix = "s3/${var.bucket_name}/"
}

data "aws_iam_policy_document" "adapters" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.adapters.arn,
      "${aws_s3_bucket.adapters.arn}/*",
    ]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  # Uploads without encryption headers get the bucket default (this key); one that names another key is refused.
  statement {
    sid       = "DenyOtherKmsKey"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.adapters.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Null"
      variable = "s3:x-amz-server-side-encryption-aws-kms-key-id"
      values   = ["false"]
    }
    condition {
      test     = "StringNotEquals"
      variable = "s3:x-amz-server-side-encryption-aws-kms-key-id"
      values   = [aws_kms_key.bucket.arn]
    }
  }

  statement {
    sid       = "DenyNonKmsEncryption"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.adapters.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Null"
      variable = "s3:x-amz-server-side-encryption"
      values   = ["false"]
    }
    condition {
      test     = "StringNotEquals"
      variable = "s3:x-amz-server-side-encryption"
      values   = ["aws:kms"]
    }
  }
}

resource "aws_s3_bucket_policy" "adapters" {
  bucket = aws_s3_bucket.adapters.id
  policy = data.aws_iam_policy_document.adapters.json

  depends_on = [aws_s3_bucket_public_access_block.adapters]
}
