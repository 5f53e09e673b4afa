"""Prometheus metrics of one engine, in its own registry (several engines may share a process in tests)."""
from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_ADAPTER_LABELS = 64
MAX_TENANT_LABELS = 32
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model"], registry=r).labels(**labels)

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r).labels(**labels)

        self.ttft = hist("mplex_engine_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("mplex_engine_inter_token_latency_seconds", "Time between consecutive generated tokens")
        self.e2e = hist("mplex_engine_e2e_request_latency_seconds", "Arrival to finish", (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120))
        self.step_time = hist("mplex_engine_step_seconds", "Wall time of one forward step")
        self.running = gauge("mplex_engine_requests_running", "Sequences in the running batch")
        self.waiting = gauge("mplex_engine_requests_waiting", "Sequences waiting for admission")
        self.kv_used = gauge("mplex_engine_kv_blocks_used", "KV cache blocks in use (incl. cached idle blocks held by requests)")
        self.kv_total = gauge("mplex_engine_kv_blocks_total", "KV cache blocks in the pool")
        self.kv_bytes_per_token = gauge("mplex_engine_kv_cache_bytes_per_token",
                                        "KV cache bytes per token slot over all layers, K and V (fp8: scales included)")
        self._kv_info = Gauge("mplex_engine_kv_cache_info", "KV cache storage (1 for the engine's kv_dtype)",
                              ["model", "kv_dtype"], registry=r)
        self.prompt_tokens = counter("mplex_engine_prompt_tokens_total", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("mplex_engine_generation_tokens_total", "Generated tokens")
        self.prefix_hit_tokens = counter("mplex_engine_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache")
        self._preemptions = Counter(
            "mplex_engine_preemptions_total", "Sequences preempted, by kind: swap (KV to the host tier and back) "
            "or recompute (KV freed, computed again)", ["model", "kind"], registry=r,
        )
        for kind in ("swap", "recompute"):  # exported from the start, as before the kind label
            self._preemptions.labels(model=model_name, kind=kind)
        self._init_kv(counter, gauge)
        self.busy_seconds = counter("mplex_engine_busy_seconds_total", "Wall time spent in forward steps")
        self.idle_seconds = counter("mplex_engine_idle_seconds_total", "Wall time with no work")
        self._init_lora(counter, gauge, hist)
        self._adapter_requests = Counter(
            "mplex_engine_adapter_requests_total", "Finished requests per adapter", ["model", "adapter"], registry=r
        )
        self._adapter_tokens = Counter(
            "mplex_engine_adapter_tokens_total", "Prompt + generated tokens per adapter", ["model", "adapter"], registry=r
        )
        self._adapter_labels: set[str] = set()
        self.finished = Counter(
            "mplex_engine_requests_total", "Finished requests", ["model", "finish_reason"], registry=r
        )
        self.request_failures = Counter(
            "mplex_engine_request_failures_total",
            "Requests failed by an error inside the engine, by where it was caught: step (the forward, "
            "pinned on a request by re-running the step's sequences one by one), postprocess (one "
            "request's output handling) or unattributed (the step's requests were failed and state checked)",
            ["model", "where"], registry=r,
        )
        self.shed = Counter("mplex_engine_shed_total", "Requests refused at arrival: their estimated time to first "
                            "token was over their class's budget (engine_overloaded)", ["model", "priority"], registry=r)
        self.fair_preemptions = counter("mplex_engine_fair_preemptions_total",
                                        "Sequences preempted to seat a tenant under its fair share")
        self.max_tokens_clamped = counter("mplex_engine_max_tokens_clamped_total",
                                          "Batch-class requests whose max_tokens overload clamped")
        self._tenant_waiting = Gauge("mplex_engine_tenant_waiting", "Waiting requests per tenant (bounded labels)",
                                     ["model", "tenant"], registry=r)
        self._tenant_ttft = Histogram("mplex_engine_tenant_ttft_seconds", "Arrival to first token per tenant "
                                      "(bounded labels)", ["model", "tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self._tenant_labels: set[str] = set()
        self._tenant_waiting_set: set[str] = set()
        self.model_name = model_name
        self._spec_tokens = Counter(
            "mplex_engine_spec_tokens_total", "Speculative decoding: draft tokens proposed and verified (kind=draft) "
            "and accepted (kind=accepted), per adapter (base: the base model; bounded labels)",
            ["model", "adapter", "kind"], registry=r)

    def _init_kv(self, counter, gauge) -> None:
        """KV tiering: swap traffic, the host tier, copy-on-write forks and the cost model's estimates."""
        self.swap_out_blocks = counter("mplex_engine_kv_swap_out_blocks_total", "KV blocks copied to the host tier")
        self.swap_in_blocks = counter("mplex_engine_kv_swap_in_blocks_total", "KV blocks copied back from the host tier")
        self.swap_out_bytes = counter("mplex_engine_kv_swap_out_bytes_total", "Bytes of KV copied to the host tier")
        self.swap_in_bytes = counter("mplex_engine_kv_swap_in_bytes_total", "Bytes of KV copied back from the host tier")
        self.swap_seconds = counter("mplex_engine_kv_swap_seconds_total", "Wall time of host <-> device KV copies")
        self.host_blocks_used = gauge("mplex_engine_kv_host_blocks_used", "Host-tier KV blocks held by swapped-out sequences")
        self.host_blocks_total = gauge("mplex_engine_kv_host_blocks_total", "Host-tier KV blocks (0: no host tier)")
        self.cow_copies = counter("mplex_engine_kv_cow_copies_total", "KV blocks copied on the first write into a shared block")
        self.forks = counter("mplex_engine_kv_forks_total", "Requests that forked an identical running prompt's KV")
        self.fork_tokens = counter("mplex_engine_kv_fork_shared_tokens_total", "Prompt tokens forks shared instead of computing")
        self.copy_bandwidth = gauge("mplex_engine_kv_copy_bytes_per_second", "Running estimate of host <-> device KV copy bandwidth")
        self.prefill_token_seconds = gauge("mplex_engine_prefill_seconds_per_token", "Running estimate of a prefill token's cost (recompute)")

    def _init_lora(self, counter, gauge, hist) -> None:
        """Adapter slots and loads."""
        self.lora_slots_used = gauge("mplex_engine_lora_slots_used", "Device adapter slots holding an adapter")
        self.lora_slots_total = gauge("mplex_engine_lora_slots_total", "Device adapter slots")
        self.lora_host_cached = gauge("mplex_engine_lora_host_cached", "Adapters resident in host memory")
        self.lora_loads = counter("mplex_engine_lora_loads_total", "Adapter loads into host memory (fetch + validate)")
        self.lora_load_failures = counter("mplex_engine_lora_load_failures_total", "Adapter loads refused")
        self.lora_slot_loads = counter("mplex_engine_lora_slot_loads_total", "Adapter copies into a device slot")
        self.lora_load_seconds = hist("mplex_engine_lora_load_seconds", "Adapter load time (fetch + validate + convert)")

    def count_preemptions(self, kind: str, n: int) -> None:
        if n:
            self._preemptions.labels(model=self.model_name, kind=kind).inc(n)

    def set_kv_cache_info(self, kv_dtype: str, bytes_per_token: float) -> None:
        self._kv_info.labels(model=self.model_name, kv_dtype=kv_dtype).set(1)
        self.kv_bytes_per_token.set(bytes_per_token)

    def count_finished(self, reason: str) -> None:
        self.finished.labels(model=self.model_name, finish_reason=reason).inc()

    def tenant_label(self, tenant: str) -> str:
        """Tenants are unbounded: the first MAX_TENANT_LABELS seen get a label (their id's first 12
        characters), the rest count as "other"; requests without a tenant (direct use) as "direct"."""
        label = tenant[:12] or "direct"
        if label not in self._tenant_labels:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                return "other"
            self._tenant_labels.add(label)
        return label

    def step_tokens(self, itls: list[float], n: int) -> None:
        """A step's generated tokens: the counter once, and their inter-token latencies -- equal for every row
        that also had a token in the previous step -- observed once per distinct value (observe_n). Per token
        these two calls were ~3% of a cold burst's wall time in the engine's one step thread."""
        if n:
            self.generation_tokens.inc(n)
        for value, count in collections.Counter(itls).items():
            observe_n(self.itl, value, count)

    def tenant_ttft(self, tenant: str):
        return self._tenant_ttft.labels(model=self.model_name, tenant=self.tenant_label(tenant))

    def set_tenant_waiting(self, waiting: dict[str, int]) -> None:
        now: dict[str, int] = {}
        for tenant, n in waiting.items():
            label = self.tenant_label(tenant)
            now[label] = now.get(label, 0) + n
        for label in self._tenant_waiting_set - now.keys():
            self._tenant_waiting.labels(model=self.model_name, tenant=label).set(0)
        for label, n in now.items():
            self._tenant_waiting.labels(model=self.model_name, tenant=label).set(n)
        self._tenant_waiting_set = set(now)

    def count_adapter(self, name: str, tokens: int) -> None:
        """Per-adapter counters; labels are bounded: past MAX_ADAPTER_LABELS names, the rest count as "other"."""
        if name not in self._adapter_labels:
            if len(self._adapter_labels) >= MAX_ADAPTER_LABELS:
                name = "other"
            else:
                self._adapter_labels.add(name)
        self._adapter_requests.labels(model=self.model_name, adapter=name).inc()
        self._adapter_tokens.labels(model=self.model_name, adapter=name).inc(tokens)

    def count_spec(self, adapter: str | None, drafted: int, accepted: int) -> None:
        """A finished request's speculative totals, labelled by its adapter ("base" without one)."""
        name = self.adapter_label(adapter) if adapter else "base"
        self._spec_tokens.labels(model=self.model_name, adapter=name, kind="draft").inc(drafted)
        self._spec_tokens.labels(model=self.model_name, adapter=name, kind="accepted").inc(accepted)

    def adapter_label(self, name: str) -> str:
        """Past MAX_ADAPTER_LABELS adapter names, the rest count as "other"."""
        if name not in self._adapter_labels:
            if len(self._adapter_labels) >= MAX_ADAPTER_LABELS:
                return "other"
            self._adapter_labels.add(name)
        return name


def observe_n(hist, value: float, count: int) -> None:
    """`count` observations of `value` in a prometheus_client histogram child, as `count` calls of observe() would
    record them (tests/engine/test_metrics_batch.py checks the exposition against that). Uses the child's
    bucket and sum values (the pinned prometheus_client's layout); a child without them observes one by one."""
    buckets, bounds, total = getattr(hist, "_buckets", None), getattr(hist, "_upper_bounds", None), getattr(hist, "_sum", None)
    if buckets is None or bounds is None or total is None or count <= 1:
        for _ in range(count):
            hist.observe(value)
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break
