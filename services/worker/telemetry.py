"""The worker's metrics and spans, fed by three hooks around each step (on the model thread)
and one around each KV pull (on the event loop). Cheap when nothing is traced: a request is
followed only when the scheduler sent a sampled ``NewRequest.traceparent`` (which it does only
while tracing records), so an untraced step costs two dict look-ups and three histogram
observations.

Spans, for a traced request on this worker: ``prefill`` (first chunk to first sampled token,
an event per chunk with the batch it shared) and ``decode`` (first decode step to the end or
to the request leaving this worker, events for some steps with the batch size, the step count
and batch sizes), both children of the scheduler's ``schedule`` span;
``kv_transfer`` around a KvPull (disaggregated serving). A step that has detail for a traced
request also gets one ``step`` span of its own trace with a link to each such request's span:
per-step detail without a span per request per step. Decode detail (an event and a link) is
kept for a request's first DETAILED_DECODE_STEPS steps and every DETAIL_EVERY-th step; every
step counts into the decode span's ``decode_steps`` and batch-size attributes (measured cost:
docs/benchmarks.md)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.shared.messages import KvPull, StepPlan, StepResult
from kvflow.shared.telemetry import context_of, extract, is_sampled, tracer

_tracer = tracer("worker")

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_TRACKED = 10_000  # traced requests held at once; past it the oldest are let go
# per-step detail of a traced request's decode (an event on its span, a link from the step's
# span) costs ~8 µs per request: given for its first steps and every DETAIL_EVERY-th step only;
# the others count into the decode span's step count and batch-size attributes
DETAILED_DECODE_STEPS = 4
DETAIL_EVERY = 16


@dataclass
class _Req:
    ctx: Context
    outputs: int  # output tokens known (sampled here or before it came here)
    prefill: Span | None = None
    decode: Span | None = None
    decode_steps: int = 0
    batch_seqs_sum: int = 0  # over its decode steps, for the mean batch size
    batch_seqs_max: int = 0


class _Queued(Collector):
    def __init__(self, worker_id: str, queued: Callable[[], int]) -> None:
        self.worker_id, self.queued = worker_id, queued

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvflow:worker_plans_queued", "Plans received, not yet run", labels=["worker"]
        )
        g.add_metric([self.worker_id], float(self.queued()))
        yield g


BUSY_WINDOW_S = 10.0


class BusyClock(Collector):
    """The worker's busy fraction: the time it spends in steps over wall time, the figure a GPU
    operator watches (idle time between steps is the pipeline's, not the device's). Exposed as
    ``kvflow:worker_busy_fraction`` (the last ``BUSY_WINDOW_S`` seconds, a running step counted
    up to now) and ``kvflow:worker_busy_seconds_total`` (for ``rate()`` over any window). The
    model thread starts and stops it, a scrape reads it from another thread: a lock keeps the
    two consistent."""

    def __init__(self, worker_id: str, window_s: float = BUSY_WINDOW_S) -> None:
        self.worker_id, self.window_s = worker_id, window_s
        self.total_s = 0.0
        self._since: float | None = None  # the running step's start
        self._done: deque[tuple[float, float]] = deque()  # (start, end) of finished steps
        self._lock = threading.Lock()

    def start(self, now: float) -> None:
        with self._lock:
            self._since = now

    def stop(self, now: float) -> None:
        with self._lock:
            if self._since is None:
                return
            self.total_s += now - self._since
            self._done.append((self._since, now))
            self._since = None

    def fraction(self, now: float) -> float:
        lo = now - self.window_s
        with self._lock:
            while self._done and self._done[0][1] <= lo:
                self._done.popleft()
            busy = sum(end - max(start, lo) for start, end in self._done)
            if self._since is not None:
                busy += now - max(self._since, lo)
        return min(1.0, busy / self.window_s)

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        g = GaugeMetricFamily(
            "kvflow:worker_busy_fraction",
            f"Time in steps over the last {self.window_s:.0f} s of wall time (1: never idle)",
            labels=["worker"],
        )
        g.add_metric([self.worker_id], self.fraction(now))
        yield g
        with self._lock:
            since, total = self._since, self.total_s
        running = now - since if since is not None else 0.0
        c = CounterMetricFamily(
            "kvflow:worker_busy_seconds", "Seconds spent in steps", labels=["worker"]
        )
        c.add_metric([self.worker_id], total + running)
        yield c


class WorkerTelemetry:
    def __init__(self, worker_id: str, queued: Callable[[], int] = lambda: 0) -> None:
        self.worker_id = worker_id
        self.registry = CollectorRegistry()
        r, w = self.registry, ["worker"]
        self.step_seconds = Histogram(
            "kvflow:worker_step_seconds", "Time of one step", w, buckets=STEP_BUCKETS, registry=r
        )
        self.batch_seqs = Histogram(
            "kvflow:worker_batch_seqs", "Sequences per step", w, buckets=BATCH_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            "kvflow:worker_step_tokens", "Tokens per step", w, buckets=TOKEN_BUCKETS, registry=r
        )
        self.kv_bytes = Counter(
            "kvflow:worker_kv_pulled_bytes", "KV bytes pulled from other workers", w, registry=r
        )
        self.kv_pulls = Counter(
            "kvflow:worker_kv_pulls", "KV pulls from other workers, by outcome", [*w, "outcome"],
            registry=r,
        )  # fmt: skip
        self.kv_seconds = Histogram(
            "kvflow:worker_kv_pull_seconds",
            "Time of one KV pull (all its blocks)",
            w,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.expert_tokens = Histogram(
            "kvflow:worker_expert_tokens",
            "Tokens one routed expert took in one step, summed over the MoE layers (one "
            "observation per expert per step: a wide spread is an imbalanced load)",
            w,
            buckets=(0, *TOKEN_BUCKETS),
            registry=r,
        )
        self.weight_bytes = Gauge(
            "kvflow:worker_weight_bytes",
            "Bytes the model's weights hold in memory as loaded (blocks of a quantized weight "
            "count as they are held)",
            w,
            registry=r,
        )
        r.register(_Queued(worker_id, queued))
        self.busy = BusyClock(worker_id)
        r.register(self.busy)
        self.reqs: dict[str, _Req] = {}
        self.epoch = 0
        self._step: Span | None = None
        self._traced: list[tuple[Any, _Req]] = []

    # -- steps ------------------------------------------------------------------------------

    def step_started(self, plan: StepPlan) -> float:
        """Before ``plan`` runs; returns the start time to give :meth:`step_done`."""
        t0 = time.monotonic()
        self.busy.start(t0)
        if plan.epoch != self.epoch:  # a new scheduler term: the worker dropped every request
            self.epoch = plan.epoch
            for rid in list(self.reqs):
                self._drop(rid, "scheduler changed")
        for nr in plan.new_requests:
            if nr.request_id in self.reqs:
                self._drop(nr.request_id, "rescheduled")
            if is_sampled(nr.traceparent):
                if len(self.reqs) >= MAX_TRACKED:
                    self._drop(next(iter(self.reqs)), "untracked")
                self.reqs[nr.request_id] = _Req(context_of(nr.traceparent), nr.num_output_tokens)
        for rid in plan.finished_request_ids:
            if rid in self.reqs:
                self._drop(rid, "left this worker")
        self._traced = []
        if self.reqs:
            self._trace_step(plan)
        return t0

    def _trace_step(self, plan: StepPlan) -> None:
        batch_tokens = sum(len(s.token_ids) for s in plan.seqs)
        periodic = plan.step_id % DETAIL_EVERY == 0
        linked: list[Link] = []
        for s in plan.seqs:
            req = self.reqs.get(s.request_id)
            if req is None:
                continue
            self._traced.append((s, req))
            if not s.sample or len(s.token_ids) > 1 or req.outputs == 0:
                if req.prefill is None:
                    req.prefill = _tracer.start_span(
                        "prefill",
                        context=req.ctx,
                        attributes={"kvflow.worker": self.worker_id, "kvflow.recompute": req.outputs > 0},
                    )  # fmt: skip
                req.prefill.add_event(
                    "chunk",
                    {
                        "kvflow.step_id": plan.step_id,
                        "kvflow.chunk_tokens": len(s.token_ids),
                        "kvflow.start_pos": s.start_pos,
                        "kvflow.batch_seqs": len(plan.seqs),
                        "kvflow.batch_tokens": batch_tokens,
                    },
                )
                linked.append(Link(req.prefill.get_span_context()))
                continue
            if req.decode is None:
                req.decode = _tracer.start_span(
                    "decode", context=req.ctx, attributes={"kvflow.worker": self.worker_id}
                )
            req.decode_steps += 1
            req.batch_seqs_sum += len(plan.seqs)
            req.batch_seqs_max = max(req.batch_seqs_max, len(plan.seqs))
            if req.decode_steps <= DETAILED_DECODE_STEPS or periodic:
                req.decode.add_event(
                    "step", {"kvflow.step_id": plan.step_id, "kvflow.batch_seqs": len(plan.seqs)}
                )
                linked.append(Link(req.decode.get_span_context()))
        if not linked:
            return
        self._step = _tracer.start_span(
            "step",
            context=Context(),  # a trace of its own: a step serves many requests
            links=linked,
            attributes={
                "kvflow.worker": self.worker_id,
                "kvflow.step_id": plan.step_id,
                "kvflow.batch_seqs": len(plan.seqs),
                "kvflow.batch_tokens": batch_tokens,
                "kvflow.new_requests": len(plan.new_requests),
            },
        )

    def expert_load(self, load: list[int] | None) -> None:
        """A step's tokens per expert (``DecoderModel.take_expert_load``; None: no MoE)."""
        if load:
            h = self.expert_tokens.labels(self.worker_id)
            for n in load:
                h.observe(n)

    def step_done(self, plan: StepPlan, result: StepResult, t0: float) -> None:
        """After ``plan`` ran, before its ``result`` is sent (the step's time is the worker's
        own measure in ``result.step_time_s``, else the time since ``t0``)."""
        w = self.worker_id
        self.busy.stop(time.monotonic())
        self.step_seconds.labels(w).observe(result.step_time_s or time.monotonic() - t0)
        self.batch_seqs.labels(w).observe(len(plan.seqs))
        self.step_tokens.labels(w).observe(result.num_computed_tokens)
        if not self._traced:
            return
        step, self._step = self._step, None
        if result.error:
            if step is not None:
                step.set_status(Status(StatusCode.ERROR, result.error))
                step.end()
            for s, _ in self._traced:
                self._drop(s.request_id, "step failed")
            self._traced = []
            return
        sampled = dict(zip(result.request_ids, result.finish_reasons, strict=True))
        for s, req in self._traced:
            if s.request_id not in sampled:
                continue
            req.outputs += 1
            if req.prefill is not None:
                req.prefill.add_event("first_token")
                req.prefill.end()
                req.prefill = None
            if sampled[s.request_id]:  # a finish reason
                self._drop(s.request_id, "finished")
        self._traced = []
        if step is not None:
            step.set_attribute("kvflow.sampled", len(result.request_ids))
            step.end()

    def _drop(self, rid: str, why: str) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            return
        if req.prefill is not None:
            req.prefill.set_attribute("kvflow.end", why)
            req.prefill.end()
        if req.decode is not None:
            req.decode.set_attribute("kvflow.decode_steps", req.decode_steps)
            req.decode.set_attribute("kvflow.batch_seqs_max", req.batch_seqs_max)
            mean = req.batch_seqs_sum / max(1, req.decode_steps)
            req.decode.set_attribute("kvflow.batch_seqs_mean", round(mean, 2))
            req.decode.set_attribute("kvflow.end", why)
            req.decode.end()

    # -- KV pulls ---------------------------------------------------------------------------

    def pull_started(self, order: KvPull, headers: dict[str, str] | None) -> Span:
        return _tracer.start_span(
            "kv_transfer",
            context=extract(headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "kvflow.request_id": order.request_id,
                "kvflow.worker": self.worker_id,
                "kvflow.src_worker": order.src_worker,
                "kvflow.blocks": len(order.dst_blocks),
            },
        )

    def pull_done(
        self, span: Span, ok: bool, num_bytes: int, seconds: float, error: str | None
    ) -> None:
        w = self.worker_id
        self.kv_pulls.labels(w, "ok" if ok else "failed").inc()
        if ok:
            self.kv_bytes.labels(w).inc(num_bytes)
            self.kv_seconds.labels(w).observe(seconds)
        span.set_attribute("kvflow.bytes", num_bytes)
        if not ok:
            span.set_status(Status(StatusCode.ERROR, error or "failed"))
        span.end()
