"""The Grafana dashboard: it queries exactly the agreed metric names, its panels are well-formed and cover the
SLO, capacity, queue, error and cost views; the series helper speaks prometheus_client's naming."""
from __future__ import annotations

import json

import pytest
from ops_support import INFRA, REPO, load_file_module
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

series = load_file_module(INFRA / "grafana" / "series.py")
DASHBOARD = INFRA / "grafana" / "multiplex.json"

# The contract with the services: these are exported by engine, gateway and worker (tests scrape /metrics).
HISTOGRAMS = {
    "mplex_engine_time_to_first_token_seconds", "mplex_engine_inter_token_latency_seconds",
    "mplex_engine_e2e_request_latency_seconds", "mplex_engine_lora_load_seconds",
    "mplex_gateway_request_duration_seconds", "mplex_gateway_ttft_seconds", "mplex_gateway_tpot_seconds",
    "mplex_worker_task_duration_seconds",
}
GAUGES = {
    "mplex_engine_requests_running", "mplex_engine_requests_waiting", "mplex_engine_kv_blocks_used",
    "mplex_engine_kv_blocks_total", "mplex_engine_lora_slots_used", "mplex_engine_lora_slots_total",
    "mplex_worker_queue_depth",
}
COUNTERS = {
    "mplex_engine_prompt_tokens_total", "mplex_engine_generation_tokens_total",
    "mplex_engine_prefix_cache_hit_tokens_total", "mplex_engine_preemptions_total",
    "mplex_engine_busy_seconds_total", "mplex_engine_idle_seconds_total",
    "mplex_gateway_requests_total", "mplex_gateway_slo_requests_total", "mplex_gateway_quota_rejections_total",
    "mplex_gateway_tokens_total", "mplex_gateway_billed_microusd_total", "mplex_gateway_upstream_errors_total",
    "mplex_worker_tasks_total",
}
CONTRACT = HISTOGRAMS | GAUGES | COUNTERS


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(node: dict) -> list[dict]:
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found.extend(all_panels(panel))
    return found


def test_dashboard_queries_exactly_the_contract_metrics():
    assert series.dashboard_series(DASHBOARD) == CONTRACT


def test_panels_are_well_formed():
    panels = all_panels(dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 20
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            # Histograms are only ever read through their buckets or count, never as a bare name.
            for name in series.promql_series(expr):
                assert name not in HISTOGRAMS, f"{panel['title']}: bare histogram {name}"


def test_dashboard_covers_the_operational_views():
    titles = " | ".join(p["title"].lower() for p in all_panels(dashboard()))
    for view in ("time to first token (p50 / p99)", "time per output token (p50 / p99)", "goodput vs slo",
                 "output tokens/s", "kv cache occupancy", "adapter slots used / total", "adapter load time (p50 / p99)",
                 "quota rejections", "engine requests waiting / running", "celery queue depth", "5xx rate by route",
                 "4xx rate by route", "per 1m tokens"):
        assert view in titles, view
    quantiles = [t["expr"] for p in all_panels(dashboard()) for t in p.get("targets", []) if "histogram_quantile" in t["expr"]]
    assert any("histogram_quantile(0.99" in q for q in quantiles) and any("histogram_quantile(0.5" in q for q in quantiles)


def test_terraform_provisions_this_dashboard():
    example = (INFRA / "terraform" / "examples" / "aws" / "main.tf").read_text()
    assert 'file("${path.module}/../../../grafana/multiplex.json")' in example
    assert (INFRA / "terraform" / "examples" / "aws" / "../../../grafana/multiplex.json").resolve() == DASHBOARD


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('histogram_quantile(0.99, sum by (le, route) (rate(a_seconds_bucket{route=~"/v1.*"}[5m])))', {"a_seconds_bucket"}),
        ('sum(rate(x_total{met="true"}[$__rate_interval])) / sum(rate(x_total[1h]))', {"x_total"}),
        ("(count(b_total) * $gpu_hourly_usd / 3600) / sum(rate(c_total[1h])) * 1e6", {"b_total", "c_total"}),
        ("a / ignoring(pod) group_left(queue) b offset 5m > bool 3", {"a", "b"}),
        ('label_values(d_running{job="x"}, namespace)', {"d_running"}),
        ('max by (queue) (q_depth{namespace=~"$namespace", queue!="sum"})', {"q_depth"}),
    ],
)
def test_promql_series_extracts_only_metric_names(expr, expected):
    assert series.promql_series(expr) == expected


def test_exposed_series_matches_prometheus_client_naming():
    registry = CollectorRegistry()
    metric_for = {"histogram": Histogram, "gauge": Gauge, "counter": Counter}
    for name in sorted(CONTRACT):
        kind = "histogram" if name in HISTOGRAMS else "gauge" if name in GAUGES else "counter"
        metric_for[kind](name, "contract metric", ["route"], registry=registry).labels(route="/v1/chat/completions")
    text = generate_latest(registry).decode()
    exposed = series.exposed_series(text)
    assert series.dashboard_series(DASHBOARD) <= exposed
    assert "mplex_engine_time_to_first_token_seconds_bucket" not in exposed
    # A scrape that lacks a series must show up as missing, e.g. an engine without adapter slots.
    partial = "\n".join(line for line in text.splitlines() if "lora_slots_total" not in line)
    assert series.dashboard_series(DASHBOARD) - series.exposed_series(partial) == {"mplex_engine_lora_slots_total"}


def test_operations_doc_lists_every_dashboard_metric():
    doc = (REPO / "docs" / "operations.md").read_text()
    missing = sorted(name for name in CONTRACT if name not in doc)
    assert missing == []
