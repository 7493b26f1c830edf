"""Observability over real servers: trace context in real NATS headers, the SDK's OTLP/HTTP
exporter into `kvflow traces`' receiver, and the gateway's whole-stack metrics gathered from
services' ops objects over a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from kvflow.cli.traces import OtlpReceiver, timeline
from kvflow.shared.bus import Bus
from kvflow.shared.messages import Abort
from kvflow.shared.metrics import gather, whole_stack
from kvflow.shared.ops_http import OpsServer
from kvflow.shared.telemetry import extract, inject

pytestmark = pytest.mark.integration


def _provider(service: str) -> TracerProvider:
    return TracerProvider(resource=Resource.create({"service.name": service}))


async def test_trace_context_rides_in_nats_headers(nats_url) -> None:
    tracer = _provider("t").get_tracer("t")
    a, b = Bus("a"), Bus("b")
    await a.connect(nats_url)
    await b.connect(nats_url)
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, raw) -> None:
        await got.put((msg, raw.headers))

    try:
        await b.subscribe("t.trace", handler)
        parent = tracer.start_span("publish")
        await a.publish("t.trace", Abort("r1"), inject(parent))
        await a.publish("t.trace", Abort("r2"))  # no context: no headers at all
        (m1, h1), (m2, h2) = [await asyncio.wait_for(got.get(), 5) for _ in range(2)]
        child = tracer.start_span("handle", context=extract(h1))
        assert m1 == Abort("r1") and m2 == Abort("r2") and not h2
        assert child.get_span_context().trace_id == parent.get_span_context().trace_id
        assert child.parent.span_id == parent.get_span_context().span_id
        # both directions counted with their bytes
        assert a.traffic[("t.trace", "out")][0] == 2
        assert b.traffic[("t.trace", "in")] == a.traffic[("t.trace", "out")]
    finally:
        await a.close()
        await b.close()


def test_otlp_http_exporter_into_the_receiver_and_a_timeline() -> None:
    rx = OtlpReceiver().start()
    try:
        provider = _provider("kvflow-gateway")
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{rx.endpoint}/v1/traces"))
        )
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("POST /v1/completions") as root:
            with tracer.start_as_current_span("tokenize", attributes={"kvflow.n": 3}) as tok:
                tok.add_event("first_token", {"kvflow.step_id": 1})
        other = tracer.start_span("step", context=trace.set_span_in_context(trace.INVALID_SPAN))
        other.add_link(root.get_span_context())
        other.end()
        provider.shutdown()
        tid = format(root.get_span_context().trace_id, "032x")
        spans = {s.name: s for s in rx.store.trace(tid)}
        assert set(spans) == {"POST /v1/completions", "tokenize"}
        assert spans["tokenize"].parent_id == spans["POST /v1/completions"].span_id
        assert spans["POST /v1/completions"].parent_id == ""
        assert spans["tokenize"].service == "kvflow-gateway"
        assert spans["tokenize"].attributes == {"kvflow.n": 3}
        assert [e[0] for e in spans["tokenize"].events] == ["first_token"]
        (step,) = [s for s in rx.store.all_spans() if s.name == "step"]
        assert step.links == [(tid, spans["POST /v1/completions"].span_id)]
        text = timeline(rx.store.trace(tid))
        lines = text.splitlines()
        assert lines[0].startswith(f"trace {tid}: 2 spans")
        assert lines[1].startswith("POST /v1/completions") and lines[2].startswith("  tokenize")
        assert ". first_token" in lines[3] and "step_id=1" in lines[3]
    finally:
        rx.stop()


async def test_whole_stack_metrics_are_gathered_from_every_instance(nats_url) -> None:
    buses = [Bus("tokenizer"), Bus("worker-0"), Bus("worker-1")]
    services = ["tokenizer", "worker", "worker"]
    gateway = Bus("gateway")
    await gateway.connect(nats_url)
    try:
        for bus, service in zip(buses, services, strict=True):
            await bus.connect(nats_url)
            OpsServer(service).set_ready(lambda: True, bus)  # answers on kvflow.metrics
        await asyncio.sleep(0.2)  # the answering subscriptions are made by spawned tasks
        for bus in buses:
            await bus.client.flush()
        reports = await gather(gateway, 0.5)
        assert sorted(r.service for r in reports) == ["tokenizer", "worker", "worker"]
        text = whole_stack(b"", "gateway", "gw", reports).decode()
        ready = {
            (s.labels["service"], s.labels["service_instance"].split("@")[0])
            for f in text_string_to_metric_families(text)
            if f.name == "kvflow_service_ready"
            for s in f.samples
        }
        assert ready == {("tokenizer", "tokenizer"), ("worker", "worker-0"), ("worker", "worker-1")}
        assert text.count("# TYPE process_resident_memory_bytes gauge") == 1  # merged, once
        # each answer was counted on its own bus (the request in, the report out)
        assert buses[0].traffic[("kvflow.metrics", "in")][0] == 1
        assert buses[0].traffic[("_INBOX", "out")][0] == 1
    finally:
        for bus in [*buses, gateway]:
            await bus.close()
