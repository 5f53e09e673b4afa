# Multiplex on Kubernetes: namespace, identities, configuration and the shared pod conventions every
# workload below follows (non-root, read-only root filesystem, no capabilities, RuntimeDefault seccomp).

locals {
  part_of = { "app.kubernetes.io/part-of" = "multiplex" }

  labels = {
    gateway = merge(local.part_of, { "app.kubernetes.io/name" = "mplex", "app.kubernetes.io/component" = "gateway" })
    engine  = merge(local.part_of, { "app.kubernetes.io/name" = "mplex", "app.kubernetes.io/component" = "engine" })
    beat    = merge(local.part_of, { "app.kubernetes.io/name" = "mplex", "app.kubernetes.io/component" = "beat" })
    migrate = merge(local.part_of, { "app.kubernetes.io/name" = "mplex", "app.kubernetes.io/component" = "migrate" })
  }
  worker_labels = {
    for k, w in var.workers : k => merge(local.part_of, {
      "app.kubernetes.io/name"      = "mplex"
      "app.kubernetes.io/component" = "worker"
      "mplex.ai/queue"              = k
    })
  }

  # One uid/gid baked into both images (infra/docker); fsGroup makes mounted volumes writable for it.
  uid = 10001

  storage_url = "s3://${var.storage_bucket}/${var.storage_prefix}"

  # Service-account names must match the IRSA trust policies in the iam module.
  service_accounts = {
    gateway = "mplex-gateway"
    engine  = "mplex-engine"
    worker  = "mplex-worker"
    beat    = "mplex-beat"
  }

  gpu_toleration = {
    key      = "nvidia.com/gpu"
    operator = "Exists"
    effect   = "NoSchedule"
  }

  # The migration Job's name changes with the image, so a new release runs `mplex db upgrade` before rollout.
  migrate_job_name = "mplex-migrate-${substr(sha1(var.gateway_image), 0, 10)}"
}

resource "kubernetes_namespace_v1" "mplex" {
  metadata {
    name = var.namespace
    labels = merge(local.part_of, {
      # Pod Security Admission: the restricted profile is exactly the conventions above, enforced by the API server.
      "pod-security.kubernetes.io/enforce" = "restricted"
      "pod-security.kubernetes.io/audit"   = "restricted"
    })
  }
}

resource "kubernetes_service_account_v1" "gateway" {
  metadata {
    name      = local.service_accounts.gateway
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.gateway
  }
  automount_service_account_token = false
}

resource "kubernetes_service_account_v1" "engine" {
  metadata {
    name      = local.service_accounts.engine
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.engine
    annotations = {
      "eks.amazonaws.com/role-arn"               = var.engine_role_arn
      "eks.amazonaws.com/sts-regional-endpoints" = "true"
    }
  }
  automount_service_account_token = false # IRSA projects its own token; no pod talks to the Kubernetes API
}

resource "kubernetes_service_account_v1" "worker" {
  metadata {
    name      = local.service_accounts.worker
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = merge(local.part_of, { "app.kubernetes.io/component" = "worker" })
    annotations = {
      "eks.amazonaws.com/role-arn"               = var.worker_role_arn
      "eks.amazonaws.com/sts-regional-endpoints" = "true"
    }
  }
  automount_service_account_token = false
}

resource "kubernetes_service_account_v1" "beat" {
  metadata {
    name      = local.service_accounts.beat
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.labels.beat
  }
  automount_service_account_token = false
}

resource "kubernetes_config_map_v1" "env" {
  metadata {
    name      = "mplex-env"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.part_of
  }

  data = {
    MPLEX_ENV         = "prod"
    MPLEX_STORAGE_URL = local.storage_url
    MPLEX_HOME        = "/var/lib/mplex"
    AWS_REGION        = var.aws_region
    # Read-only root filesystem: every cache a library wants goes to the writable scratch volume.
    HOME             = "/tmp"
    TMPDIR           = "/tmp"
    HF_HOME          = "/tmp/hf"
    HF_HUB_OFFLINE   = "1" # weights come from the model volume, never from a hub
    TRITON_CACHE_DIR = "/tmp/triton"
    PYTHONUNBUFFERED = "1"
  }
}

# Secrets Manager is the system of record (modules/secrets); this Secret is its projection for the pods, written
# in the same apply so first start-up needs no extra operator. Rotation: update the secret, re-apply, roll the pods.
resource "kubernetes_secret_v1" "env" {
  metadata {
    name      = "mplex-env"
    namespace = kubernetes_namespace_v1.mplex.metadata[0].name
    labels    = local.part_of
  }

  type = "Opaque"
  data = {
    MPLEX_DATABASE_URL = format(
      #checkov:skip=CKV_SECRET_4:A format() template: the %s placeholders are filled from sensitive variables, no credential is in the file.
      "postgresql+psycopg://%s:%s@%s:%d/%s?sslmode=%s&sslrootcert=/etc/ssl/certs/rds-global-bundle.pem",
      var.database.username, urlencode(var.database_password), var.database.host, var.database.port,
      var.database.name, var.database.sslmode,
    )
    MPLEX_REDIS_URL  = format("rediss://:%s@%s:%d/0?ssl_cert_reqs=required", urlencode(var.redis_auth_token), var.redis.host, var.redis.port)
    MPLEX_BROKER_URL = format("rediss://:%s@%s:%d/1?ssl_cert_reqs=required", urlencode(var.redis_auth_token), var.redis.host, var.redis.port)
    MPLEX_SECRET_KEY = var.secret_key
    # Engines accept these tokens; the gateway (and the engines' preStop hook) send the first.
    MPLEX_ENGINE_TOKENS = var.engine_tokens
  }
}

# Engine model volumes: gp3 with enough throughput that a 70B FP8 checkpoint syncs in minutes, not tens of them.
resource "kubernetes_storage_class_v1" "models" {
  metadata {
    name   = "mplex-models"
    labels = local.part_of
  }
  storage_provisioner    = "ebs.csi.aws.com"
  reclaim_policy         = "Delete"
  volume_binding_mode    = "WaitForFirstConsumer" # create the volume in the AZ the GPU node is in
  allow_volume_expansion = true
  parameters = {
    type       = "gp3"
    encrypted  = "true"
    iops       = "16000"
    throughput = "1000"
  }
}
