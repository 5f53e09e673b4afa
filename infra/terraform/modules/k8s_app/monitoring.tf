# Prometheus + Grafana (kube-prometheus-stack) scraping every Multiplex Service labelled mplex.ai/scrape, the
# Multiplex dashboard provisioned into Grafana, and prometheus-adapter turning our series into the custom and
# external metrics the autoscalers read.

resource "kubernetes_namespace_v1" "monitoring" {
  count = var.install_monitoring ? 1 : 0
  metadata {
    name = var.monitoring_namespace
  }
}

resource "random_password" "grafana_admin" {
  count   = var.install_monitoring ? 1 : 0
  length  = 32
  special = false
}

resource "kubernetes_secret_v1" "grafana_admin" {
  count = var.install_monitoring ? 1 : 0
  metadata {
    name      = "grafana-admin"
    namespace = kubernetes_namespace_v1.monitoring[0].metadata[0].name
  }
  data = {
    admin-user     = "admin"
    admin-password = random_password.grafana_admin[0].result
  }
}

# The token Prometheus sends when it scrapes engines (their /metrics requires the platform credential). A
# ServiceMonitor reads Secrets from its own namespace only, hence this copy of the first (sending) token.
resource "kubernetes_secret_v1" "engine_scrape" {
  count = var.install_monitoring ? 1 : 0
  metadata {
    name      = "mplex-engine-scrape"
    namespace = kubernetes_namespace_v1.monitoring[0].metadata[0].name
  }
  data = {
    token = trimspace(split(",", var.engine_tokens)[0])
  }
}

resource "kubernetes_config_map_v1" "dashboards" {
  for_each = var.install_monitoring ? var.dashboards : {}
  metadata {
    name      = "grafana-dashboard-${trimsuffix(each.key, ".json")}"
    namespace = kubernetes_namespace_v1.monitoring[0].metadata[0].name
    labels    = { grafana_dashboard = "1" } # picked up by the Grafana dashboard sidecar
  }
  data = {
    (each.key) = each.value
  }
}

locals {
  prometheus_url = "http://kube-prometheus-stack-prometheus.${var.monitoring_namespace}.svc"

  adapter_rules = {
    custom = [
      {
        seriesQuery  = "mplex_gateway_requests_total{namespace!=\"\",pod!=\"\"}"
        resources    = { overrides = { namespace = { resource = "namespace" }, pod = { resource = "pod" } } }
        name         = { matches = "^mplex_gateway_requests_total$", as = "mplex_gateway_requests_per_second" }
        metricsQuery = "sum(rate(<<.Series>>{<<.LabelMatchers>>}[2m])) by (<<.GroupBy>>)"
      },
      {
        seriesQuery  = "mplex_engine_requests_waiting{namespace!=\"\",pod!=\"\"}"
        resources    = { overrides = { namespace = { resource = "namespace" }, pod = { resource = "pod" } } }
        name         = { matches = "^mplex_engine_requests_waiting$", as = "mplex_engine_requests_waiting" }
        metricsQuery = "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
      },
      {
        seriesQuery  = "mplex_engine_kv_blocks_used{namespace!=\"\",pod!=\"\"}"
        resources    = { overrides = { namespace = { resource = "namespace" }, pod = { resource = "pod" } } }
        name         = { matches = "^mplex_engine_kv_blocks_used$", as = "mplex_engine_kv_occupancy" }
        metricsQuery = "sum(mplex_engine_kv_blocks_used{<<.LabelMatchers>>}) by (<<.GroupBy>>) / sum(mplex_engine_kv_blocks_total{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
      },
    ]
    external = [
      {
        # Every worker reports the broker's queue lengths; they agree, so take the max per queue.
        seriesQuery  = "mplex_worker_queue_depth{queue!=\"\"}"
        resources    = { overrides = { namespace = { resource = "namespace" } } }
        name         = { matches = "^mplex_worker_queue_depth$", as = "mplex_worker_queue_depth" }
        metricsQuery = "max(<<.Series>>{<<.LabelMatchers>>}) by (queue)"
      },
    ]
  }
}

resource "helm_release" "kube_prometheus_stack" {
  count      = var.install_monitoring ? 1 : 0
  name       = "kube-prometheus-stack"
  repository = "https://prometheus-community.github.io/helm-charts"
  chart      = "kube-prometheus-stack"
  version    = var.chart_versions.kube_prometheus_stack
  namespace  = kubernetes_namespace_v1.monitoring[0].metadata[0].name

  values = [yamlencode({
    prometheus = {
      prometheusSpec = {
        retention                               = var.prometheus_retention
        nodeSelector                            = var.cpu_node_selector
        serviceMonitorSelectorNilUsesHelmValues = false
        storageSpec = {
          volumeClaimTemplate = {
            spec = {
              accessModes = ["ReadWriteOnce"]
              resources   = { requests = { storage = "100Gi" } }
            }
          }
        }
      }
      additionalServiceMonitors = [{
        name              = "multiplex"
        selector          = { matchLabels = { "mplex.ai/scrape" = "true" } }
        namespaceSelector = { matchNames = [var.namespace] }
        endpoints = [
          { port = "metrics", path = "/metrics", interval = "15s" },
          {
            # Engines (the only scraped Service with an "http" port): bearer token from the Secret above.
            port = "http", path = "/metrics", interval = "15s",
            authorization = {
              type        = "Bearer"
              credentials = { name = kubernetes_secret_v1.engine_scrape[0].metadata[0].name, key = "token" }
            }
          },
        ]
      }]
    }
    grafana = {
      admin = {
        existingSecret = kubernetes_secret_v1.grafana_admin[0].metadata[0].name
        userKey        = "admin-user"
        passwordKey    = "admin-password" #checkov:skip=CKV_SECRET_6:The name of a key inside the Secret, not a credential.
      }
      nodeSelector = var.cpu_node_selector
      sidecar      = { dashboards = { enabled = true, label = "grafana_dashboard", labelValue = "1", searchNamespace = var.monitoring_namespace } }
    }
    alertmanager = { alertmanagerSpec = { nodeSelector = var.cpu_node_selector } }
  })]
}

resource "helm_release" "prometheus_adapter" {
  count      = var.install_monitoring ? 1 : 0
  name       = "prometheus-adapter"
  repository = "https://prometheus-community.github.io/helm-charts"
  chart      = "prometheus-adapter"
  version    = var.chart_versions.prometheus_adapter
  namespace  = kubernetes_namespace_v1.monitoring[0].metadata[0].name

  values = [yamlencode({
    prometheus   = { url = local.prometheus_url, port = 9090 }
    nodeSelector = var.cpu_node_selector
    rules = {
      default  = false
      custom   = local.adapter_rules.custom
      external = local.adapter_rules.external
    }
  })]

  depends_on = [helm_release.kube_prometheus_stack]
}
