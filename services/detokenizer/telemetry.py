"""The detokenizer's metrics: time per StepResult, tokens turned into text, requests held,
requests taken over from detokenizers that died."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _Active(Collector):
    def __init__(self, active: Callable[[], int], taken_over: Callable[[], int]) -> None:
        self.active = active
        self.taken_over = taken_over

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvflow:detokenizer_active_requests", "Requests this detokenizer holds"
        )
        g.add_metric([], float(self.active()))
        yield g
        c = CounterMetricFamily(
            "kvflow:detokenizer_takeovers",
            "Requests taken over from a detokenizer that died (services/detokenizer/takeover.py)",
        )
        c.add_metric([], float(self.taken_over()))
        yield c


class DetokenizerMetrics:
    def __init__(self, active: Callable[[], int], taken_over: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.steps = Histogram(
            "kvflow:detokenizer_step_seconds",
            "Time to turn one StepResult into deltas and send them",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvflow:detokenizer_tokens", "Tokens turned into text", registry=self.registry
        )
        self.registry.register(_Active(active, taken_over))
