"""The scheduler's metrics and spans. The service calls four hooks (a request queued, a plan
sent, a result applied, an abort); everything else reads the core's state at scrape time.

Metrics (vLLM's names where vLLM has one): running and waiting requests, KV cache usage,
prefix cache queries and hits (in tokens, as vLLM counts them), preemptions, tokens per step,
and per request the time queued, in prefill (first scheduled to first token), in decode (first
token to the end) and running; kvflow's own: workers, KV usage per worker, KV transfers between
workers and KV tier loads (from the core's totals), leadership.

Spans: each request has a ``schedule`` span from its arrival here to its end (the child of the
tokenizer's span; its context goes to the worker in ``NewRequest.traceparent`` and with KvPull
orders in NATS headers), with a ``queued`` child (arrival to first plan) and a ``chunk`` child
per prefill chunk (plan sent to result applied), which names the worker, the step and the
batch it shared, and an ``assigned`` event each time a worker is sent the request (first
placement, hand-off to a decode worker, re-placement after a preemption). Decode steps add
nothing per step here (the worker's spans show them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.sequence import Sequence
from kvflow.shared.messages import FinishReason, StepPlan, StepResult, TokenizedRequest
from kvflow.shared.telemetry import extract, inject, traceparent, tracer

_tracer = tracer("scheduler")

# vLLM's request latency buckets (vllm/v1/metrics/loggers.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_TRACKED = 100_000  # requests followed at once; past it the oldest are let go


@dataclass
class _Live:
    span: Span
    arrival: float
    queued: Span | None
    first_scheduled: float = 0.0
    first_token: float = 0.0
    chunks: dict[int, Span] = field(default_factory=dict)  # step id -> prefill chunk span


class SchedulerTelemetry:
    """The metrics and spans of a scheduler: ``core`` is read at scrape time, ``leading`` says
    whether it leads now, and with ``lora_enabled`` the adapters of running and waiting
    requests are exported too."""

    def __init__(
        self,
        core: SchedulerCore,
        model_name: str,
        scheduler_id: str,
        leading: Callable[[], bool],
        lora_enabled: bool = False,
    ) -> None:
        self.core = core
        self.model = model_name
        self.scheduler_id = scheduler_id
        self.leading = leading
        self.lora_enabled = lora_enabled
        self.registry = CollectorRegistry()
        m, r = ["model_name"], self.registry

        def hist(name: str, doc: str, buckets: tuple = REQUEST_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.queue_time = hist("vllm:request_queue_time_seconds", "Time waiting to be scheduled")
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token"
        )
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to the end")
        self.inference_time = hist(
            "vllm:request_inference_time_seconds", "First scheduled to the end"
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Tokens per step", ITERATION_TOKEN_BUCKETS
        )
        r.register(_EngineCollector(self))
        self.live: dict[str, _Live] = {}

    # -- hooks ----------------------------------------------------------------------------

    def on_request(self, req: TokenizedRequest, headers: dict[str, str] | None) -> None:
        """A request arrived; followed if the core queued it (not a duplicate or refusal)."""
        rid = req.request_id
        if rid in self.live or rid not in self.core.requests:
            return
        if len(self.live) >= MAX_TRACKED:
            self._end(next(iter(self.live)), "untracked")
        span = _tracer.start_span(
            "schedule",
            context=extract(headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "kvflow.request_id": rid,
                "kvflow.prompt_tokens": len(req.prompt_token_ids),
                "kvflow.priority": req.priority,
            },
        )
        queued = None
        if span.is_recording():
            queued = _tracer.start_span("queued", context=trace.set_span_in_context(span))
        self.live[rid] = _Live(span, time.monotonic(), queued)

    def on_plan(self, worker_id: str, plan: StepPlan) -> None:
        """A plan is about to be sent: first schedules end their queue time, prefill chunks
        get a span, and new requests carry their trace context to the worker."""
        now = time.monotonic()
        num_tokens = sum(len(s.token_ids) for s in plan.seqs)
        self.iteration_tokens.labels(self.model).observe(num_tokens)
        for nr in plan.new_requests:
            live = self.live.get(nr.request_id)
            if live is not None and live.span.is_recording():
                nr.traceparent = traceparent(live.span)
                # on a worker for the first time, or again (hand-off to decode, preemption)
                live.span.add_event(
                    "assigned",
                    {"kvflow.worker": worker_id, "kvflow.output_tokens": nr.num_output_tokens},
                )
        for s in plan.seqs:
            live = self.live.get(s.request_id)
            if live is None:
                continue
            if not live.first_scheduled:
                live.first_scheduled = now
                self.queue_time.labels(self.model).observe(now - live.arrival)
                if live.queued is not None:
                    live.queued.end()
                    live.queued = None
            if not live.first_token and live.span.is_recording():
                live.chunks[plan.step_id] = _tracer.start_span(
                    "chunk",
                    context=trace.set_span_in_context(live.span),
                    attributes={
                        "kvflow.worker": worker_id,
                        "kvflow.step_id": plan.step_id,
                        "kvflow.chunk_tokens": len(s.token_ids),
                        "kvflow.start_pos": s.start_pos,
                        "kvflow.batch_seqs": len(plan.seqs),
                        "kvflow.batch_tokens": num_tokens,
                    },
                )

    def on_result(
        self, plan: StepPlan, result: StepResult, finished: list[tuple[Any, Any]]
    ) -> None:
        """``plan``'s result was applied; ``finished``: the (sequence, reason) pairs it ended."""
        now = time.monotonic()
        for s in plan.seqs:
            live = self.live.get(s.request_id)
            if live is not None:
                chunk = live.chunks.pop(result.step_id, None)
                if chunk is not None:
                    chunk.end()
        if not result.error:  # a first token, or an embedding request's vector
            for rid in [*result.request_ids, *(e.request_id for e in result.embeddings)]:
                live = self.live.get(rid)
                if live is not None and not live.first_token and live.first_scheduled:
                    live.first_token = now
                    self.prefill_time.labels(self.model).observe(now - live.first_scheduled)
                    live.span.add_event("first_token")
        for seq, reason in finished:
            self._spec_attributes(seq)
            self._finish(seq.request_id, FinishReason(reason), now)

    def on_abort(self, request_id: str, reason: FinishReason) -> None:
        """An Abort: a stop string (reason STOP, from the detokenizer) ends a request as
        normally as EOS does; anything else is an abort."""
        self._spec_attributes(self.core.requests.get(request_id))
        self._finish(request_id, reason, time.monotonic())

    def _spec_attributes(self, seq: Sequence | None) -> None:
        """Speculative decoding's share of a request that ends, on its span."""
        if seq is None or seq.spec is None:
            return
        live = self.live.get(seq.request_id)
        if live is not None:
            live.span.set_attribute("kvflow.spec_draft_tokens", seq.spec.drafted)
            live.span.set_attribute("kvflow.spec_accepted_tokens", seq.spec.accepted)

    def headers(self, request_id: str) -> dict[str, str]:
        """NATS headers with a request's span context (for orders about that request)."""
        live = self.live.get(request_id)
        return inject(live.span) if live is not None else {}

    # -- ends -------------------------------------------------------------------------------

    def _finish(self, rid: str, reason: FinishReason, now: float) -> None:
        live = self.live.get(rid)
        if live is None:
            return
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and live.first_token:
            self.decode_time.labels(self.model).observe(now - live.first_token)
            self.inference_time.labels(self.model).observe(now - live.first_scheduled)
        self._end(rid, reason.openai() or "none")

    def _end(self, rid: str, reason: str) -> None:
        live = self.live.pop(rid)
        for span in [live.queued, *live.chunks.values()]:
            if span is not None:
                span.end()
        live.span.set_attribute("kvflow.finish_reason", reason)
        live.span.end()


class _EngineCollector(Collector):
    """Series read from the scheduler's state at scrape time (the ops endpoint's thread or
    the event loop): only ints, lists snapshotted with ``list()``."""

    def __init__(self, telemetry: SchedulerTelemetry) -> None:
        self.t = telemetry

    def collect(self) -> Iterator[Metric]:
        t, model = self.t, self.t.model
        core = t.core
        workers = list(core.workers.values())
        m = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=m)
            g.add_metric([model], float(value))
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=m)
            c.add_metric([model], float(value))
            return c

        total = sum(w.bm.num_blocks for w in workers)
        used = total - sum(w.bm.num_free_blocks for w in workers)
        yield gauge(
            "vllm:num_requests_running",
            "Requests in the workers' running batches",
            sum(len(w.running) for w in workers),
        )
        yield gauge("vllm:num_requests_waiting", "Requests waiting", len(core.waiting))
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage (0-1)", used / total if total else 0
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens (full blocks looked up x block size)",
            sum(w.bm.prefix_queries * w.bm.block_size for w in workers),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in tokens",
            sum(w.bm.prefix_hits * w.bm.block_size for w in workers),
        )
        yield counter(
            "vllm:num_preemptions",
            "Preemptions (by recompute, for want of KV blocks)",
            sum(w.num_preemptions for w in workers),
        )
        yield gauge("kvflow:workers", "Workers known to the scheduler", len(workers))
        yield counter(
            "kvflow:computed_tokens",
            "Tokens run through the model, all workers (prefix hits skip)",
            core.num_computed_tokens,
        )
        leader = GaugeMetricFamily(
            "kvflow:scheduler_leader", "1 while this scheduler leads", labels=["scheduler"]
        )
        leader.add_metric([t.scheduler_id], 1.0 if t.leading() else 0.0)
        yield leader
        yield from self._workers(workers)
        yield from self._kv_moves(core)
        if core.speculator is not None:
            yield from _spec_decode(core.speculator.stats, model)
        if t.lora_enabled:
            yield _lora_info(workers, core.waiting.sequences(), core.limits.max_loras)

    def _workers(self, workers: list[Any]) -> Iterator[Metric]:
        labels = ["worker", "role"]
        usage = GaugeMetricFamily(
            "kvflow:worker_kv_cache_usage_perc", "KV cache usage per worker (0-1)", labels=labels
        )
        running = GaugeMetricFamily(
            "kvflow:worker_requests_running", "Requests running per worker", labels=labels
        )
        for w in workers:
            key = [w.worker_id, w.role]
            n = w.bm.num_blocks
            usage.add_metric(key, (n - w.bm.num_free_blocks) / n if n else 0.0)
            running.add_metric(key, float(len(w.running)))
        yield usage
        yield running

    def _kv_moves(self, core: Any) -> Iterator[Metric]:
        t = core.router.transfer_totals
        transfers = CounterMetricFamily(
            "kvflow:kv_transfers", "KV transfers between workers, by outcome", labels=["outcome"]
        )
        transfers.add_metric(["ok"], float(t.done))
        transfers.add_metric(["failed"], float(t.failed))
        yield transfers
        yield CounterMetricFamily(
            "kvflow:kv_transfer_bytes", "KV bytes moved between workers", value=t.num_bytes
        )
        yield CounterMetricFamily(
            "kvflow:kv_transfer_seconds",
            "Time KV transfers took, summed (order to done)",
            value=t.seconds,
        )
        tiers = core.router.tier_totals
        hits = CounterMetricFamily(
            "kvflow:kv_tier_hits",
            "KV blocks loaded from a tier instead of recomputed",
            labels=["tier"],
        )
        hits.add_metric(["host"], float(tiers.host_hits))
        hits.add_metric(["redis"], float(tiers.redis_hits))
        yield hits
        yield CounterMetricFamily(
            "kvflow:kv_tier_misses", "KV blocks ordered but found in no tier", value=tiers.misses
        )
        yield CounterMetricFamily("kvflow:kv_tier_loads", "KV tier loads done", value=tiers.loads)
        yield CounterMetricFamily(
            "kvflow:kv_tier_bytes", "KV bytes loaded from the tiers", value=tiers.num_bytes
        )
        yield CounterMetricFamily(
            "kvflow:kv_tier_load_seconds", "Time KV tier loads took, summed", value=tiers.seconds
        )
        yield CounterMetricFamily(
            "kvflow:kv_tier_offloaded_blocks",
            "Evicted KV blocks copied to host tiers",
            value=tiers.offloaded,
        )


def _spec_decode(stats: Any, model: str) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (a ``SpecStats``)."""
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Verification steps with drafts", stats.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", stats.num_draft_tokens),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            stats.num_accepted_tokens,
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model], float(value))
        yield c
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first)",
        labels=["model_name", "position"],
    )
    for pos, n in enumerate(list(stats.accepted_per_pos)):
        per_pos.add_metric([model, str(pos)], float(n))
    yield per_pos


def _lora_info(workers: list[Any], waiting: list[Any], max_loras: int) -> Metric:
    """vLLM's ``vllm:lora_requests_info``: the adapters of running and of waiting requests
    (comma-separated names) and ``max_lora``, as labels; the value is the time."""
    running = sorted({s.lora.name for w in workers for s in list(w.running) if s.lora})
    queued = sorted({s.lora.name for s in waiting if s.lora})
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    g.add_metric([",".join(running), ",".join(queued), str(max_loras)], time.time())
    return g
