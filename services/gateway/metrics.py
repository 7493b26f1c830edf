"""Prometheus metrics the gateway observes, with vLLM's names (``vllm:*``) so existing vLLM
dashboards work, plus kvflow's own (``kvflow:*``).

Request-level series (TTFT, inter-token latency, end-to-end latency, prompt and generated
tokens, finished requests by reason) are observed here, where the client's view of time is:
token counters add up to the ``usage`` the clients received (a prompt counts once, however many
sequences it has). Engine series (running and waiting requests, KV usage, prefix cache,
preemptions, queue / prefill / decode time) are the scheduler's and worker's own
(services/scheduler/telemetry.py, services/worker/telemetry.py); the gateway's ``/metrics``
serves them too, gathered over NATS (shared/metrics.py), unless asked for ``?scope=local``."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _OpenRequests(Collector):
    def __init__(self, model: str, count: Callable[[], int]) -> None:
        self.model, self.count = model, count

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvflow:gateway_open_requests", "Requests open here", labels=["model_name"]
        )
        g.add_metric([self.model], float(self.count()))
        yield g


class LoopHistogram(Collector):
    """A histogram observed on one thread (the event loop) and read at scrape time, exported
    under each of ``names`` with the same samples.

    prometheus_client's ``Histogram.observe`` walks the buckets and makes two locked increments
    (~1.4 us). Inter-token latency is observed once per delta of every stream, under two names,
    which cost the gateway ~2.8 us per streamed token. Here an observation is a bisect and two
    additions (~0.3 us) and both names share them. A scrape from another thread may read the
    counts and the sum one observation apart, which a histogram tolerates."""

    def __init__(
        self,
        names: Sequence[tuple[str, str]],
        label_names: Sequence[str],
        label_values: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        self.names = list(names)
        self.label_names, self.label_values = list(label_names), list(label_values)
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """``value`` observed ``times`` times."""
        # a value equal to a bound belongs to that bucket (``le``): the first bound >= value
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*self.bounds, float("inf")], counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        for name, doc in self.names:
            h = HistogramMetricFamily(name, doc, labels=self.label_names)
            h.add_metric(self.label_values, buckets, sum_value=total)
            yield h


class GatewayMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        self.model = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # observed per delta (per token: a delta of n tokens counts n), so without a lock;
        # exported under vLLM's name and the one it used before 0.11 (older dashboards read it)
        self.itl = LoopHistogram(
            [
                ("vllm:inter_token_latency_seconds", "Time between output tokens"),
                (
                    "vllm:time_per_output_token_seconds",
                    "Time between output tokens (vLLM's older name for inter-token latency)",
                ),
            ],
            m,
            [model_name],
            ITL_BUCKETS,
        )
        r.register(self.itl)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency",
            m,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request",
            m,
            buckets=token_buckets,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per request",
            m,
            buckets=token_buckets,
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
        self.aborts = Counter(
            "kvflow:gateway_aborts", "Requests aborted by the gateway", m, registry=r
        )

        # the per-delta series, labelled once (labels() takes a lock and a dict lookup)
        self.ttft_of_model = self.ttft.labels(model_name)

    def track_open_requests(self, count: Callable[[], int]) -> None:
        """``kvflow:gateway_open_requests`` reads ``count()`` at scrape time."""
        self.registry.register(_OpenRequests(self.model, count))

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        """This gateway's own series: process metrics and the registry above."""
        return generate_latest(REGISTRY) + generate_latest(self.registry)


class RequestTimer:
    """Observes one sequence's timings as its deltas arrive."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.done = False

    def delta(self, num_new_tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft_of_model.observe(now - self.start)
        elif num_new_tokens:  # a delta of n tokens: n latencies of a nth of its wait each
            self.m.itl.observe((now - self.last) / num_new_tokens, num_new_tokens)
        self.last = now

    def finished(self, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Once per sequence (later calls do nothing). ``prompt_tokens`` is 0 for all but one
        sequence of a prompt, so a prompt's tokens count once."""
        if self.done:
            return
        self.done = True
        label = self.m.model
        self.m.e2e.labels(label).observe(time.perf_counter() - self.start)
        self.m.prompt_tokens.labels(label).inc(prompt_tokens)
        self.m.generation_tokens.labels(label).inc(completion_tokens)
        if prompt_tokens:
            self.m.request_prompt_tokens.labels(label).observe(prompt_tokens)
        self.m.request_generation_tokens.labels(label).observe(completion_tokens)
        self.m.success.labels(label, reason or "unknown").inc()
