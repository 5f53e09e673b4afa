"""Gateway Prometheus metrics (names match infra/grafana/multiplex.json; labels are bounded sets)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.15):
        self.registry = r = CollectorRegistry()
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.requests = Counter("mplex_gateway_requests_total", "Requests by route and HTTP status", ["route", "status"], registry=r)
        self.duration = Histogram("mplex_gateway_request_duration_seconds", "Request duration (to the last byte)", ["route"], buckets=_BUCKETS, registry=r)
        self.ttft = Histogram("mplex_gateway_ttft_seconds", "Request accepted to first token sent", buckets=_BUCKETS, registry=r)
        self.tpot = Histogram("mplex_gateway_tpot_seconds", "Time per output token after the first", buckets=_TOKEN_BUCKETS, registry=r)
        self.slo = Counter("mplex_gateway_slo_requests_total", "Completed generations by whether they met both SLOs", ["met"], registry=r)
        self.quota_rejections = Counter("mplex_gateway_quota_rejections_total", "Requests refused by a quota window", ["reason"], registry=r)
        self.tokens = Counter("mplex_gateway_tokens_total", "Tokens metered", ["kind"], registry=r)
        self.billed = Counter("mplex_gateway_billed_microusd_total", "Amount billed for metered requests (micro-USD)", registry=r)
        self.upstream_errors = Counter("mplex_gateway_upstream_errors_total", "Engine failures (incl. retried ones)", ["kind"], registry=r)
        self.in_flight = Gauge("mplex_gateway_requests_in_flight", "Open generation requests", registry=r)
        self.spool_depth = Gauge("mplex_gateway_usage_spool_depth", "Usage events waiting for Postgres", registry=r)
        self.ledger_writes = Counter("mplex_gateway_ledger_writes_total", "Usage events written", ["via"], registry=r)
        # Children of the per-request labels, looked up once: `labels()` costs a lock and a dict walk each call.
        self.prompt_tokens, self.cached_tokens, self.completion_tokens = (
            self.tokens.labels(kind=kind) for kind in ("prompt", "cached", "completion"))
        self._slo_met = {met: self.slo.labels(met="true" if met else "false") for met in (True, False)}
        self._routes: dict[tuple[str, int], tuple] = {}
        for kind in ("connect", "refused", "stream", "overloaded"):
            self.upstream_errors.labels(kind=kind)

    def observe_generation(self, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        if ttft is not None:
            met = ttft <= self.slo_ttft_s and (tpot is None or tpot <= self.slo_tpot_s)
            self._slo_met[met].inc()

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """One request's count and duration by route template (a bounded set) and status."""
        children = self._routes.get((route, status))
        if children is None:
            children = self._routes[(route, status)] = (self.requests.labels(route=route, status=str(status)),
                                                        self.duration.labels(route=route))
        children[0].inc()
        children[1].observe(seconds)
