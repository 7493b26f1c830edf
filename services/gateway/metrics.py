"""Prometheus metrics on the gateway's ``/metrics``, with vLLM's names (``vllm:*``) so existing
vLLM dashboards work, plus kvflow's own (``kvflow:*``).

Request-level series (TTFT, inter-token latency, end-to-end latency, tokens, finished requests
by reason) are observed here, where the client's view of time is. Engine series (running and
waiting requests, KV usage, prefix cache, preemptions) come from the scheduler's stats, fetched
at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.messages import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output deltas",
            m,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", m, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by reason",
            [*m, "finished_reason"],
            registry=r,
        )
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch", m, registry=r
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", m, registry=r)
        self.prefix_queries = Gauge(
            "vllm:prefix_cache_queries_total",
            "Prefix cache blocks looked up (cumulative)",
            m,
            registry=r,
        )
        self.prefix_hits = Gauge(
            "vllm:prefix_cache_hits_total", "Prefix cache blocks found (cumulative)", m, registry=r
        )
        self.preemptions = Gauge(
            "vllm:num_preemptions_total", "Preemptions (cumulative)", m, registry=r
        )
        self.workers = Gauge("kvflow:workers", "Workers known to the scheduler", m, registry=r)
        self.computed = Gauge(
            "kvflow:computed_tokens_total",
            "Tokens run through the model (cumulative)",
            m,
            registry=r,
        )
        self.open_requests = Gauge(
            "kvflow:gateway_open_requests", "Requests open here", m, registry=r
        )
        self.aborts = Counter(
            "kvflow:gateway_aborts", "Requests aborted by the gateway", m, registry=r
        )

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def update_engine(self, s: SchedulerStats, open_requests: int) -> None:
        m = self.model
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        used = s.num_total_blocks - s.num_free_blocks
        self.kv_usage.labels(m).set(used / s.num_total_blocks if s.num_total_blocks else 0.0)
        self.prefix_queries.labels(m).set(s.prefix_cache_queries)
        self.prefix_hits.labels(m).set(s.prefix_cache_hits)
        self.preemptions.labels(m).set(s.num_preemptions)
        self.workers.labels(m).set(s.num_workers)
        self.computed.labels(m).set(s.num_computed_tokens)
        self.open_requests.labels(m).set(open_requests)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one choice's timings as its deltas arrive."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics
        self.start = time.perf_counter()
        self.last: float | None = None

    def delta(self, num_new_tokens: int) -> None:
        now = time.perf_counter()
        label = self.m.model
        if self.last is None:
            self.m.ttft.labels(label).observe(now - self.start)
        elif num_new_tokens:
            self.m.itl.labels(label).observe(now - self.last)
        self.last = now

    def finished(self, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        label = self.m.model
        self.m.e2e.labels(label).observe(time.perf_counter() - self.start)
        self.m.prompt_tokens.labels(label).inc(prompt_tokens)
        self.m.generation_tokens.labels(label).inc(completion_tokens)
        self.m.success.labels(label, reason or "unknown").inc()
