"""Tracing and metrics pieces offline: trace context in headers and in NewRequest, the worker's
and the scheduler's spans and histograms for one request driven through a real SchedulerCore
(spans caught by an in-memory exporter), JSON logs with request and trace ids, bus series, and
the merge of several services' expositions into one."""

from __future__ import annotations

import json
import logging
import types

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.services.gateway.metrics import (
    ITL_BUCKETS,
    GatewayMetrics,
    LoopHistogram,
    buckets_1_2_5,
)
from kvflow.services.gateway.tracing import RequestTrace
from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.telemetry import SchedulerTelemetry
from kvflow.services.worker.telemetry import WorkerTelemetry
from kvflow.shared.bus import Bus
from kvflow.shared.logs import ContextFilter, JsonFormatter, request_scope
from kvflow.shared.messages import (
    FinishReason,
    NewRequest,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.metrics import BusCollector, merge, parse_families
from kvflow.shared.subjects import subject_label
from kvflow.shared.telemetry import context_of, extract, inject, is_sampled, traceparent

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans():
    """Spans ended during the test, from the process's tracer provider (installed once: the
    global provider cannot be replaced)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_kvflow_test_exporter", False):
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        provider._kvflow_test_exporter = True  # type: ignore[attr-defined]
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def _by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in finished:
        out.setdefault(s.name, []).append(s)
    return out


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    for fam in registry.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not exported")


# -- context ------------------------------------------------------------------------------------


def test_context_travels_in_headers_and_in_a_traceparent_string(spans) -> None:
    tracer = trace.get_tracer("t")
    parent = tracer.start_span("parent")
    headers = inject(parent)
    assert headers["traceparent"].startswith("00-")
    assert headers["traceparent"] == traceparent(parent)
    assert is_sampled(headers["traceparent"])
    child = tracer.start_span("child", context=extract(headers))
    again = tracer.start_span("again", context=context_of(traceparent(parent)))
    pid = parent.get_span_context().span_id
    for s in (child, again):
        assert s.get_span_context().trace_id == parent.get_span_context().trace_id
        assert s.parent is not None and s.parent.span_id == pid
    # nothing to carry: no header, and a new trace from an empty context
    assert inject(trace.INVALID_SPAN) == {}
    assert not trace.get_current_span(extract(None)).get_span_context().is_valid
    assert not is_sampled("") and not is_sampled("00-" + "1" * 32 + "-" + "2" * 16 + "-00")


def test_gateway_span_honours_the_client_traceparent_and_ends_once(spans) -> None:
    client_tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    t = RequestTrace("/v1/completions", {"traceparent": client_tp}, "m")
    assert t.headers()["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    t.first_delta()
    t.end(200, None, 5, 3)
    t.end(500, "again")  # ignored
    got = _by_name(spans.get_finished_spans())
    server = got["POST /v1/completions"][0]
    assert server.parent.span_id == 0xB7AD6B7169203331
    assert server.kind is trace.SpanKind.SERVER
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.usage.output_tokens"] == 3
    assert [e.name for e in server.events] == ["first_token"]
    assert got["respond"][0].parent.span_id == server.context.span_id


# -- worker -------------------------------------------------------------------------------------


def _plan(step: int, seqs: list[ScheduledSeq], new: list[NewRequest] = ()) -> StepPlan:
    return StepPlan(step, seqs, list(new), epoch=1)


def test_worker_spans_prefill_chunks_decode_steps_and_links_each_step(spans) -> None:
    sched = trace.get_tracer("t").start_span("schedule")
    w = WorkerTelemetry("w0")
    nr = NewRequest("r1", SamplingParams(), 20, traceparent=traceparent(sched))
    untraced = NewRequest("r2", SamplingParams(), 4)  # the scheduler sent no context
    steps = [
        (_plan(1, [ScheduledSeq("r1", [1] * 16, 0, [0], sample=False)], [nr]), [], []),
        (
            _plan(2, [ScheduledSeq("r1", [1] * 4, 16, [0, 1]), ScheduledSeq("r2", [2] * 4, 0, [2])], [untraced]),
            ["r1", "r2"],
            [0, 0],
        ),
        (_plan(3, [ScheduledSeq("r1", [7], 20, [0, 1]), ScheduledSeq("r2", [8], 4, [2])]), ["r1", "r2"], [0, 0]),
        (_plan(4, [ScheduledSeq("r1", [7], 21, [0, 1]), ScheduledSeq("r2", [8], 5, [2])]), ["r1", "r2"], [2, 0]),
    ]  # fmt: skip
    for plan, rids, reasons in steps:
        t0 = w.step_started(plan)
        tokens = sum(len(s.token_ids) for s in plan.seqs)
        w.step_done(
            plan, StepResult("w0", plan.step_id, rids, [9] * len(rids), reasons, tokens), t0
        )
    sched.end()
    got = _by_name(spans.get_finished_spans())
    (prefill,) = got["prefill"]
    (decode,) = got["decode"]
    for s in (prefill, decode):
        assert s.parent.span_id == sched.get_span_context().span_id
        assert s.context.trace_id == sched.get_span_context().trace_id
    chunks = [e.attributes["kvflow.chunk_tokens"] for e in prefill.events if e.name == "chunk"]
    assert chunks == [16, 4]
    assert prefill.events[-1].name == "first_token"
    assert [e.attributes["kvflow.batch_seqs"] for e in prefill.events if e.name == "chunk"] == [
        1,
        2,
    ]
    assert decode.attributes["kvflow.decode_steps"] == 2
    assert decode.attributes["kvflow.end"] == "finished"
    # one step span per step that ran r1, each in a trace of its own, linked to r1's span there
    step_spans = sorted(got["step"], key=lambda s: s.attributes["kvflow.step_id"])
    assert [s.attributes["kvflow.step_id"] for s in step_spans] == [1, 2, 3, 4]
    assert all(s.parent is None for s in step_spans)
    assert [s.links[0].context.span_id for s in step_spans] == [prefill.context.span_id] * 2 + [
        decode.context.span_id
    ] * 2
    assert all(len(s.links) == 1 for s in step_spans)  # r2 is not traced: no link, no span
    assert w.reqs == {}  # r1 finished: nothing held
    assert _sample(w.registry, "kvflow:worker_step_seconds_count", worker="w0") == 4
    assert _sample(w.registry, "kvflow:worker_batch_seqs_sum", worker="w0") == 7


def test_worker_decode_detail_is_kept_for_the_first_steps_and_every_16th(spans) -> None:
    sched = trace.get_tracer("t").start_span("schedule")
    w = WorkerTelemetry("w0")
    nr = NewRequest("r", SamplingParams(), 4, num_output_tokens=1, traceparent=traceparent(sched))
    for step in range(1, 41):  # a decode worker: the first token came from the prefill worker
        others = [ScheduledSeq(f"o{i}", [1], 9, [1]) for i in range(step % 3)]
        plan = _plan(
            step, [ScheduledSeq("r", [5], 3 + step, [0]), *others], [nr] if step == 1 else []
        )
        finish = [int(FinishReason.LENGTH) if step == 40 else 0]
        w.step_done(plan, StepResult("w0", step, ["r"], [6], finish), w.step_started(plan))
    got = _by_name(spans.get_finished_spans())
    (decode,) = got["decode"]
    assert "prefill" not in got
    detailed = [e.attributes["kvflow.step_id"] for e in decode.events]
    assert detailed == [1, 2, 3, 4, 16, 32]
    assert decode.attributes["kvflow.decode_steps"] == 40
    assert decode.attributes["kvflow.batch_seqs_max"] == 3
    assert decode.attributes["kvflow.batch_seqs_mean"] == round(
        sum(1 + s % 3 for s in range(1, 41)) / 40, 2
    )
    assert sorted(s.attributes["kvflow.step_id"] for s in got["step"]) == detailed


def test_worker_without_traced_requests_makes_no_spans(spans) -> None:
    w = WorkerTelemetry("w0")
    plan = _plan(1, [ScheduledSeq("r", [1, 2], 0, [0])], [NewRequest("r", SamplingParams(), 2)])
    w.step_done(plan, StepResult("w0", 1, ["r"], [3], [1], 2), w.step_started(plan))
    assert spans.get_finished_spans() == ()
    assert _sample(w.registry, "kvflow:worker_step_tokens_sum", worker="w0") == 2


# -- scheduler ----------------------------------------------------------------------------------


class _Scheduler:
    """A core (by default with one worker) and the telemetry of a leading scheduler s0 on it."""

    def __init__(self, core: SchedulerCore | None = None, lora_enabled: bool = False) -> None:
        if core is None:
            core = SchedulerCore(SchedulerLimits(max_num_batched_tokens=32), model="m")
            core.add_worker("w0", 16, 16)
        self.core = core
        self.tel = SchedulerTelemetry(core, "m", "s0", lambda: True, lora_enabled)


def test_scheduler_times_each_phase_and_hands_its_context_to_the_worker(spans) -> None:
    tokenize = trace.get_tracer("t").start_span("tokenize")
    svc = _Scheduler()
    tel = svc.tel
    req = TokenizedRequest("r1", "inbox", list(range(40)), SamplingParams(max_tokens=2))
    svc.core.add_request(req)
    tel.on_request(req, inject(tokenize))
    ws = svc.core.workers["w0"]
    sent: list[StepPlan] = []

    def step(tokens: list[int], reasons: list[int]) -> None:
        plan, _ = svc.core.schedule(ws)
        assert plan is not None
        tel.on_plan("w0", plan)
        sent.append(plan)
        rids = [s.request_id for s in plan.seqs if s.sample]
        result = StepResult("w0", plan.step_id, rids, tokens[: len(rids)], reasons[: len(rids)])
        outcome = svc.core.on_result(result)
        tel.on_result(plan, result, outcome.finished)

    step([5], [0])  # chunk 1: 32 of 40 prompt tokens, no sample
    step([5], [0])  # chunk 2: the last 8, first token
    step([6], [int(FinishReason.LENGTH)])  # decode: max_tokens reached
    tokenize.end()
    got = _by_name(spans.get_finished_spans())
    (schedule,) = got["schedule"]
    assert schedule.parent.span_id == tokenize.get_span_context().span_id
    assert schedule.attributes["kvflow.finish_reason"] == "length"
    assert [e.name for e in schedule.events] == ["assigned", "first_token"]
    assert schedule.events[0].attributes["kvflow.worker"] == "w0"
    assert got["queued"][0].parent.span_id == schedule.context.span_id
    chunks = sorted(got["chunk"], key=lambda s: s.attributes["kvflow.step_id"])
    assert [c.attributes["kvflow.chunk_tokens"] for c in chunks] == [32, 8]  # decode: none
    # the worker gets the schedule span's context in the request's NewRequest
    (nr,) = sent[0].new_requests
    assert context_of(nr.traceparent) is not None
    assert nr.traceparent == traceparent(trace.NonRecordingSpan(schedule.context))
    r = tel.registry
    for name in ("queue", "prefill", "decode", "inference"):
        assert _sample(r, f"vllm:request_{name}_time_seconds_count", model_name="m") == 1
    assert _sample(r, "vllm:iteration_tokens_total_sum", model_name="m") == 32 + 8 + 1
    assert tel.live == {}
    # engine series read from the core: all blocks free again, prefix queries in tokens
    assert _sample(r, "vllm:kv_cache_usage_perc", model_name="m") == 0.0
    assert _sample(r, "vllm:num_requests_running", model_name="m") == 0.0
    queries = _sample(r, "vllm:prefix_cache_queries_total", model_name="m")
    assert queries == ws.bm.prefix_queries * 16 and queries > 0
    assert _sample(r, "kvflow:scheduler_leader", scheduler="s0") == 1.0


def test_scheduler_counts_a_stop_string_as_a_finish_and_an_abort_as_none(spans) -> None:
    svc = _Scheduler()
    tel = svc.tel
    for rid in ("a", "b"):
        req = TokenizedRequest(rid, "inbox", [1, 2, 3], SamplingParams(max_tokens=5))
        svc.core.add_request(req)
        tel.on_request(req, None)
    plan, _ = svc.core.schedule(svc.core.workers["w0"])
    tel.on_plan("w0", plan)
    result = StepResult("w0", plan.step_id, ["a", "b"], [4, 4], [0, 0])
    tel.on_result(plan, result, svc.core.on_result(result).finished)
    tel.on_abort("a", FinishReason.STOP)  # the detokenizer saw a stop string
    tel.on_abort("b", FinishReason.ABORT)  # the client left
    assert _sample(tel.registry, "vllm:request_decode_time_seconds_count", model_name="m") == 1
    assert tel.live == {}
    ends = {
        s.attributes["kvflow.request_id"]: s.attributes["kvflow.finish_reason"]
        for s in spans.get_finished_spans()
        if s.name == "schedule"
    }
    assert ends == {"a": "stop", "b": "abort"}


def test_scheduler_spans_carry_speculative_decodings_share(spans) -> None:
    """Draft tokens verified and accepted per request, on its schedule span: at a finish and
    at a stop string's abort; the spec_decode series count the same."""
    from kvflow.shared.speculative import SpeculativeConfig

    core = SchedulerCore(
        SchedulerLimits(), model="m", speculative=SpeculativeConfig("ngram", 3, 1, 2)
    )
    ws = core.add_worker("w0", 16, 4)
    svc = _Scheduler(core)
    tel = svc.tel
    for rid in ("a", "b"):
        req = TokenizedRequest(rid, "inbox", [7, 8, 7, 8, 7], SamplingParams(max_tokens=6))
        svc.core.add_request(req)
        tel.on_request(req, None)
    plan, _ = svc.core.schedule(ws)
    result = StepResult("w0", plan.step_id, ["a", "b"], [8, 8], [0, 0])
    tel.on_result(plan, result, svc.core.on_result(result).finished)
    plan, _ = svc.core.schedule(ws)  # both draft [7, 8, 7] after "7 8 7 8 7 8"
    assert [s.token_ids for s in plan.seqs] == [[8, 7, 8, 7]] * 2
    # a: two drafts accepted, then its own 5; b: all three and the bonus (max_tokens reached)
    result = StepResult(
        "w0", plan.step_id, ["a"] * 3 + ["b"] * 4, [7, 8, 5, 7, 8, 7, 8], [0, 0, 0, 0, 0, 0, 2]
    )
    tel.on_result(plan, result, svc.core.on_result(result).finished)
    tel.on_abort("a", FinishReason.STOP)  # a stop string in a's text (then the core's abort)
    assert svc.core.abort("a")
    got = {
        s.attributes["kvflow.request_id"]: (
            s.attributes["kvflow.spec_draft_tokens"],
            s.attributes["kvflow.spec_accepted_tokens"],
        )
        for s in spans.get_finished_spans()
        if s.name == "schedule"
    }
    assert got == {"a": (3, 2), "b": (3, 3)}
    r = tel.registry
    assert _sample(r, "vllm:spec_decode_num_drafts_total", model_name="m") == 2
    assert _sample(r, "vllm:spec_decode_num_draft_tokens_total", model_name="m") == 6
    assert _sample(r, "vllm:spec_decode_num_accepted_tokens_total", model_name="m") == 5
    per_pos = [
        _sample(
            r, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position=str(i)
        )
        for i in range(3)
    ]
    assert per_pos == [2, 2, 1]
    assert svc.core.workers["w0"].bm.num_free_blocks == 16


# -- logs ---------------------------------------------------------------------------------------


def test_json_logs_carry_request_and_trace_ids(spans) -> None:
    record_holder: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            record_holder.append(self.format(record))

    handler = Keep()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter("tokenizer"))
    log = logging.getLogger("kvflow.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        span = trace.get_tracer("t").start_span("work")
        with trace.use_span(span, end_on_exit=True), request_scope("cmpl-1"):
            log.info("tokenized %d tokens", 7)
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    inside, outside = (json.loads(line) for line in record_holder)
    ctx = span.get_span_context()
    assert inside["message"] == "tokenized 7 tokens" and inside["service"] == "tokenizer"
    assert inside["request_id"] == "cmpl-1"
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert inside["level"] == "info" and inside["time"].endswith("Z")
    assert "request_id" not in outside and "trace_id" not in outside


# -- metrics ------------------------------------------------------------------------------------


def test_subject_labels_have_bounded_cardinality() -> None:
    assert subject_label("kvflow.gateway.ab12") == "kvflow.gateway.*"
    assert subject_label("kvflow.worker.prefill-0.step") == "kvflow.worker.*.step"
    assert subject_label("kvflow.worker.decode-3.kv") == "kvflow.worker.*.kv"
    assert subject_label("_INBOX.x.y") == "_INBOX"
    assert (
        subject_label("kvflow.blob.gateway.9f3c") == "kvflow.blob.gateway.*"
    )  # one per connection
    assert subject_label("kvflow.results") == "kvflow.results"


def test_bus_series_count_messages_bytes_and_backlog() -> None:
    bus = Bus("w")
    bus.count("kvflow.worker.w0.step", "in", 100)
    bus.count("kvflow.worker.w0.step", "in", 50)
    bus.count("kvflow.results", "out", 7)
    bus.subscriptions.append(("kvflow.results", types.SimpleNamespace(pending_msgs=3)))  # type: ignore[arg-type]
    r = CollectorRegistry()
    r.register(BusCollector("worker", bus))
    step = {"service": "worker", "subject": "kvflow.worker.*.step", "direction": "in"}
    assert _sample(r, "kvflow:bus_messages_total", **step) == 2
    assert _sample(r, "kvflow:bus_bytes_total", **step) == 150
    assert _sample(r, "kvflow:bus_bytes_total", subject="kvflow.results", direction="out") == 7
    assert _sample(r, "kvflow:bus_pending_messages", subject="kvflow.results") == 3


def test_expositions_merge_into_one_with_service_labels() -> None:
    def exposition(value: float) -> bytes:
        r = CollectorRegistry()
        Counter("kvflow:thing", "things", ["model_name"], registry=r).labels("m").inc(value)
        return generate_latest(r)

    text = merge(
        [
            parse_families(exposition(2), {"service": "worker", "service_instance": "w0"}),
            parse_families(exposition(3), {"service": "worker", "service_instance": "w1"}),
            parse_families(exposition(3), {"service": "worker", "service_instance": "w1"}),
        ]
    ).decode()
    assert text.count("# TYPE kvflow:thing_total counter") == 1
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "kvflow:thing"]
    totals = {
        s.labels["service_instance"]: s.value for s in fam.samples if s.name.endswith("_total")
    }
    assert totals == {"w0": 2.0, "w1": 3.0}  # the repeated report kept once


def test_gateway_counts_a_prompt_once_and_uses_vllm_buckets() -> None:
    gm = GatewayMetrics("m", max_model_len=1000)
    for prompt in (10, 0):  # the second sequence of the same prompt (n=2) passes 0
        t = gm.request_timer()
        t.delta(1)
        t.delta(1)
        t.finished("length", prompt, 2)
        t.finished("length", prompt, 2)  # once per sequence
    r = gm.registry
    assert _sample(r, "vllm:prompt_tokens_total", model_name="m") == 10
    assert _sample(r, "vllm:generation_tokens_total", model_name="m") == 4
    assert _sample(r, "vllm:request_success_total", finished_reason="length") == 2
    assert _sample(r, "vllm:request_prompt_tokens_count", model_name="m") == 1
    assert _sample(r, "vllm:time_per_output_token_seconds_count", model_name="m") == 2
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_a_delta_of_n_tokens_is_n_inter_token_latencies() -> None:
    """A delta carrying n tokens (--stream-interval, speculative decoding, a request not
    streamed) counts n latencies of a nth of the wait each: the histogram is per token."""
    gm = GatewayMetrics("m")
    t = gm.request_timer()
    t.delta(1)
    t.last -= 0.4  # the next delta came 0.4 s after the first
    t.delta(4)
    r = gm.registry
    assert _sample(r, "vllm:inter_token_latency_seconds_count", model_name="m") == 4
    assert abs(_sample(r, "vllm:inter_token_latency_seconds_sum", model_name="m") - 0.4) < 0.01
    assert _sample(r, "vllm:inter_token_latency_seconds_bucket", model_name="m", le="0.1") == 0
    assert _sample(r, "vllm:inter_token_latency_seconds_bucket", model_name="m", le="0.15") == 4


def test_the_loop_histogram_exports_what_prometheus_client_s_histogram_does() -> None:
    """Same buckets (a value equal to a bound counted in it, beyond the last in +Inf), count and
    sum as prometheus_client's Histogram, under every name it is given."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    names = [("a_seconds", "A"), ("b_seconds", "B")]
    loop = LoopHistogram(names, ["model_name"], ["m"], ITL_BUCKETS)
    ours.register(loop)
    ref = [
        Histogram(n, doc, ["model_name"], buckets=ITL_BUCKETS, registry=theirs).labels("m")
        for n, doc in names
    ]
    for v in (0.0, 0.004, 0.01, 0.0100001, 0.3, 80.0, 80.5, 1e9):
        loop.observe(v)
        for h in ref:
            h.observe(v)

    def lines(r: CollectorRegistry) -> list[str]:
        return [x for x in generate_latest(r).decode().splitlines() if "_created" not in x]

    assert lines(ours) == lines(theirs)
    assert _sample(ours, "b_seconds_bucket", le="0.01") == 3
    assert _sample(ours, "a_seconds_count", model_name="m") == 8


def test_lora_requests_info_names_running_and_waiting_adapters(spans) -> None:
    """vLLM's ``vllm:lora_requests_info``: adapters of running and of waiting requests as
    labels (a worker of max_loras 1 runs one adapter; the other waits)."""
    from kvflow.shared.messages import LoRARef

    core = SchedulerCore(SchedulerLimits(max_loras=1), model="m")
    core.add_worker("w0", 16, 4)
    svc = _Scheduler(core, lora_enabled=True)
    tel = svc.tel
    for rid, name in (("a", "sql"), ("b", "chat"), ("c", None)):
        req = TokenizedRequest(rid, "inbox", [1, 2, 3], SamplingParams(max_tokens=5))
        req.lora = LoRARef(name, 1, f"/{name}") if name else None
        svc.core.add_request(req)
    svc.core.schedule(svc.core.workers["w0"])
    info = [
        s
        for fam in tel.registry.collect()
        for s in fam.samples
        if s.name == "vllm:lora_requests_info"
    ]
    assert len(info) == 1
    labels = info[0].labels
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("sql", "chat")
    assert labels["max_lora"] == "1" and info[0].value > 0


def test_the_worker_exports_each_experts_load_per_step() -> None:
    """kvflow:worker_expert_tokens: one observation per expert per step (MoE models only)."""
    tel = WorkerTelemetry("w-moe")
    tel.expert_load(None)  # a dense model's step: nothing
    tel.expert_load([6, 0, 2, 0])
    fams = {
        f.name: f for f in text_string_to_metric_families(generate_latest(tel.registry).decode())
    }
    samples = {
        (s.name, s.labels.get("le")): s.value for s in fams["kvflow:worker_expert_tokens"].samples
    }
    assert samples[("kvflow:worker_expert_tokens_count", None)] == 4
    assert samples[("kvflow:worker_expert_tokens_sum", None)] == 8
    assert samples[("kvflow:worker_expert_tokens_bucket", "0.0")] == 2  # two idle experts


def test_the_worker_busy_fraction_is_step_time_over_wall_time() -> None:
    """kvflow:worker_busy_fraction (the last 10 s, a running step counted up to now) and
    kvflow:worker_busy_seconds_total: what a GPU operator watches for a device left waiting."""
    from kvflow.services.worker.telemetry import BusyClock

    clock = BusyClock("w", window_s=10.0)
    assert clock.fraction(100.0) == 0.0
    clock.start(100.0)
    clock.stop(103.0)  # 3 s in a step
    clock.start(105.0)
    clock.stop(106.0)  # 1 s
    assert clock.fraction(106.0) == pytest.approx(0.4)  # 4 of the last 10 s
    assert clock.fraction(112.0) == pytest.approx(0.2)  # 1 s of the first is still inside
    assert clock.fraction(114.0) == pytest.approx(0.1)  # the first has left the window
    clock.start(112.0)  # a step running for 5 s so far counts
    assert clock.fraction(117.0) == pytest.approx(0.5)
    assert clock.total_s == 4.0
    tel = WorkerTelemetry("w0")
    tel.busy.start(0.0)  # a step running since the clock's epoch: busy the whole window
    text = generate_latest(tel.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["kvflow:worker_busy_fraction"].samples[0].value == 1.0
    assert fams["kvflow:worker_busy_seconds"].samples[0].value > 0
