"""Observability of a real stack: `kvflow serve` (disaggregated: a prefill and a decode worker,
so KV moves between them) exporting traces over OTLP/HTTP to a receiver this test runs, with
per-service ops ports and JSON logs. One request's trace must hold the spans of all five
services with the right parents; /metrics after traffic must show vLLM's series with the
values the clients saw. The trace's timeline is written to .pytest_cache/trace-timeline.txt."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.cli.traces import OtlpReceiver, SpanRecord, timeline
from kvflow.shared.infra import free_port, port_is_free
from tests.helpers.stack import ROOT, openai_client, running_stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
SERVICES = ["prefill-0", "decode-0", "scheduler-0", "tokenizer", "detokenizer"]  # start order
PROMPT = (
    "Write one sentence about the sea, the wind and a small boat with a red sail. The boat "
    "leaves the harbour at dawn and the fishermen watch it go from the old stone pier."
)


def _ops_base(n: int) -> int:
    """A port P with P..P+n-1 free (kvflow serve gives its children consecutive ops ports)."""
    for _ in range(50):
        p = free_port()
        if p + n < 65536 and all(port_is_free("0.0.0.0", p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def observed():
    """(base URL, OTLP receiver, ops base port, log path) of a traced, disaggregated stack."""
    rx = OtlpReceiver().start()
    ops = _ops_base(len(SERVICES))
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # export within a fraction of a second
    }
    args = ["--prefill-workers", "1", "--decode-workers", "1", "--num-kv-blocks", "256"]
    args += ["--max-model-len", "1024", "--ops-port", str(ops), "--log-format", "json"]
    stack = running_stack("observe", *args)
    with mock.patch.dict(os.environ, env):  # kvflow serve and its children inherit it
        base = stack.__enter__()
    try:
        yield base, rx, ops, ROOT / ".pytest_cache" / "kvflow-serve-observe.log"
    finally:
        stack.__exit__(None, None, None)
        rx.stop()


def _wait_trace(rx: OtlpReceiver, trace_id: str, names: set[str]) -> list[SpanRecord]:
    deadline = time.monotonic() + 30
    while True:
        spans = rx.store.trace(trace_id)
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_trace_holds_every_service_with_parent_links(observed) -> None:
    base, rx, _, _ = observed
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai_client(base)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = {"POST /v1/chat/completions", "respond", "tokenize", "detokenize", "schedule"}
    want |= {"queued", "chunk", "prefill", "kv_transfer", "decode"}
    spans = _wait_trace(rx, trace_id, want)
    (Path(ROOT) / ".pytest_cache" / "trace-timeline.txt").write_text(timeline(spans) + "\n")
    by_name: dict[str, list[SpanRecord]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert want <= set(by_name), f"missing {want - set(by_name)}:\n{timeline(spans)}"
    services = {s.service for s in spans}
    assert {
        f"kvflow-{n}" for n in ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
    } <= services

    def one(name: str) -> SpanRecord:
        assert len(by_name[name]) == 1, f"{name}:\n{timeline(spans)}"
        return by_name[name][0]

    server, tokenize, schedule = one("POST /v1/chat/completions"), one("tokenize"), one("schedule")
    assert server.parent_id == client_span  # the client's traceparent was honoured
    assert (
        server.service == "kvflow-gateway" and server.attributes["http.response.status_code"] == 200
    )
    assert one("respond").parent_id == server.span_id
    assert tokenize.parent_id == server.span_id and tokenize.service == "kvflow-tokenizer"
    assert one("detokenize").parent_id == tokenize.span_id
    assert schedule.parent_id == tokenize.span_id and schedule.service == "kvflow-scheduler"
    assert one("queued").parent_id == schedule.span_id
    assert all(c.parent_id == schedule.span_id for c in by_name["chunk"])
    for name, worker in (
        ("prefill", "prefill-0"),
        ("kv_transfer", "decode-0"),
        ("decode", "decode-0"),
    ):
        span = one(name)
        assert span.parent_id == schedule.span_id and span.service == "kvflow-worker", name
        assert span.attributes["kvflow.worker"] == worker, name
    assert one("kv_transfer").attributes["kvflow.bytes"] > 0
    decode = one("decode")
    assert decode.attributes["kvflow.decode_steps"] == 7  # 8 tokens, the first from the prefill
    assert len([e for e in decode.events if e[0] == "step"]) >= 4  # the first steps in detail
    assert one("detokenize").attributes["kvflow.completion_tokens"] == 8
    # each worker step is a span of its own trace, linked to the request's span on that worker
    linked = {
        lk[1]
        for s in rx.store.all_spans()
        if s.name == "step"
        for lk in s.links
        if lk[0] == trace_id
    }
    assert {one("prefill").span_id, decode.span_id} <= linked


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lbls), v in samples.items()
        if n == name and all(dict(lbls).get(k) == val for k, val in labels.items())
    )


def test_metrics_after_traffic_have_vllm_names_and_the_clients_usage(observed) -> None:
    base, _, ops, log_path = observed
    client = openai_client(base)
    before = _scrape(f"{base}/metrics")
    prompt_tokens = completion_tokens = 0
    for n in (1, 1, 2):  # the same prompt: the later requests hit the prefix cache
        r = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            n=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
    assert completion_tokens == 4 * 4
    deadline = time.monotonic() + 20
    while True:  # the scheduler observes a request's end when it applies the last result
        after = _scrape(f"{base}/metrics")
        d = {
            name: _total(after, name) - _total(before, name)
            for name in (
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:e2e_request_latency_seconds_count",
                "vllm:time_to_first_token_seconds_count",
                "vllm:request_queue_time_seconds_count",
                "vllm:request_prefill_time_seconds_count",
                "vllm:request_decode_time_seconds_count",
                "vllm:prefix_cache_hits_total",
                "kvflow:kv_transfer_bytes_total",
            )
        }
        if d["vllm:request_decode_time_seconds_count"] >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert d["vllm:prompt_tokens_total"] == prompt_tokens  # a prompt counts once, as in usage
    assert d["vllm:generation_tokens_total"] == completion_tokens
    sequences = 4  # 1 + 1 + 2
    for name in ("e2e_request_latency", "time_to_first_token"):
        assert d[f"vllm:{name}_seconds_count"] == sequences, name
    for phase in ("queue", "prefill", "decode"):  # the scheduler's, per sequence
        assert d[f"vllm:request_{phase}_time_seconds_count"] == sequences, phase
    length = "vllm:request_success_total"
    assert (
        _total(after, length, finished_reason="length")
        - _total(before, length, finished_reason="length")
        == sequences
    )
    assert d["vllm:prefix_cache_hits_total"] >= 16  # at least a block of the repeated prompt
    assert d["kvflow:kv_transfer_bytes_total"] > 0
    assert 0.0 <= _total(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert _total(after, "vllm:num_requests_running") == 0
    assert _total(after, "vllm:num_requests_waiting") == 0
    assert _total(after, "vllm:prefix_cache_queries_total") >= _total(
        after, "vllm:prefix_cache_hits_total"
    )
    # every service answered the gather, and its bus traffic is there
    for service in ("gateway", "tokenizer", "scheduler", "worker", "detokenizer"):
        assert _total(after, "kvflow:bus_messages_total", service=service) > 0, service
    assert (
        _total(after, "kvflow:bus_messages_total", service="worker", subject="kvflow.results") > 0
    )
    # ?scope=local: the gateway's own series only
    local = _scrape(f"{base}/metrics?scope=local")
    assert _total(local, "vllm:generation_tokens_total") == _total(
        after, "vllm:generation_tokens_total"
    )
    assert not any(n == "vllm:num_requests_running" for n, _ in local)
    # each service's own endpoint, on consecutive ports from --ops-port
    for i, name in enumerate(SERVICES):
        own = _scrape(f"http://127.0.0.1:{ops + i}/metrics")
        assert _total(own, "kvflow_service_ready") == 1.0, name
        assert _total(own, "kvflow:bus_messages_total") > 0, name
    sched = _scrape(f"http://127.0.0.1:{ops + 2}/metrics")
    assert _total(sched, "vllm:request_decode_time_seconds_count") == _total(
        after, "vllm:request_decode_time_seconds_count"
    )
    # --log-format json reached every service: their records are JSON objects
    records = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.startswith("{")]
    assert {"gateway", "tokenizer", "scheduler", "worker", "detokenizer"} <= {
        r["service"] for r in records
    }
