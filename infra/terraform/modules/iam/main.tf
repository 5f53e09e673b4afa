# IAM roles for service accounts: engines and workers both read the adapter bucket; only workers write it
# (ingest stores validated adapters). The gateway and beat get no AWS role at all.

locals {
  tags = merge(var.tags, { "mplex/module" = "iam" })
  service_accounts = {
    engine = var.engine_service_account
    worker = var.worker_service_account
  }
}

data "aws_iam_policy_document" "assume" {
  for_each = local.service_accounts

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_provider_host}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${each.value}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_provider_host}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  for_each             = local.service_accounts
  name                 = "${var.name}-${each.key}"
  assume_role_policy   = data.aws_iam_policy_document.assume[each.key].json
  max_session_duration = 3600
  tags                 = local.tags
}

data "aws_iam_policy_document" "read" {
  statement {
    sid       = "ListBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [var.bucket_arn]
  }

  statement {
    sid       = "ReadObjects"
    actions   = ["s3:GetObject", "s3:GetObjectVersion"]
    resources = ["${var.bucket_arn}/*"]
  }

  statement {
    sid       = "DecryptObjects"
    actions   = ["kms:Decrypt"]
    resources = [var.bucket_kms_key_arn]
  }
}

data "aws_iam_policy_document" "write" {
  statement {
    sid = "WriteObjects"
    actions = [
      "s3:PutObject",
      "s3:DeleteObject", # deleting an adapter removes its files; versioning keeps the undo window
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${var.bucket_arn}/*"]
  }

  statement {
    sid       = "EncryptObjects"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [var.bucket_kms_key_arn]
  }
}

resource "aws_iam_role_policy" "read" {
  for_each = local.service_accounts
  name     = "read-adapters"
  role     = aws_iam_role.this[each.key].id
  policy   = data.aws_iam_policy_document.read.json
}

resource "aws_iam_role_policy" "write" {
  name   = "write-adapters"
  role   = aws_iam_role.this["worker"].id
  policy = data.aws_iam_policy_document.write.json
}
