"""What tracing costs: the per-step cost of the worker's and the scheduler's tracing hooks (the
only per-step tracing work), and, with ``--e2e``, decode throughput of one ``kvflow serve``
with requests traced and untraced in alternating rounds.

    python -m kvflow.benchmarks.tracing          # hooks only (~30 s)
    python -m kvflow.benchmarks.tracing --e2e    # + a kvflow serve exporting over OTLP/HTTP

Both export for real: spans go through the SDK's BatchSpanProcessor and OTLP/HTTP exporter to
a receiver (``kvflow traces``' OtlpReceiver) in another process (hooks) or thread (e2e). The
sampler is ``parentbased_always_off``, so a request is traced when its client sends a sampled
``traceparent`` and untraced otherwise: the e2e rounds compare the two on the same stack, which
keeps the machine's noise (other processes, stack to stack) out of the difference. Untraced
equals tracing switched off, bar a non-recording span per request and service.
Figures are in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import types

import httpx

from kvflow.shared.infra import free_port, wait_for_http

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _receiver(port: int) -> None:
    from kvflow.cli.traces import OtlpReceiver

    OtlpReceiver(port=port).server.serve_forever()


def _hooks(batch_sizes: tuple[int, ...], steps: int) -> list[dict]:
    """µs per step of the worker's step hooks and the scheduler's plan/result hooks, for
    ``steps`` decode steps of a batch of traced, then untraced, requests."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    port = free_port()
    rx = multiprocessing.Process(target=_receiver, args=(port,), daemon=True)
    rx.start()
    time.sleep(1.0)
    provider = TracerProvider(ParentBased(ALWAYS_OFF))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces"))
    )
    trace.set_tracer_provider(provider)
    out = []
    try:
        for batch in (1, *batch_sizes):  # the first pass warms up (imports, label children)
            for traced in (False, True):
                out.append(_hook_pass(batch, traced, steps))
        provider.force_flush()
    finally:
        provider.shutdown()
        rx.terminate()
    return out[2:]


def _hook_pass(batch: int, traced: bool, steps: int) -> dict:
    """One batch: requests queued (traced: their client sent a sampled traceparent), then one
    prefill step, then ``steps`` decode steps through both services' hooks."""
    from kvflow.services.scheduler.telemetry import SchedulerTelemetry
    from kvflow.services.worker.telemetry import WorkerTelemetry
    from kvflow.shared.messages import (
        FinishReason,
        NewRequest,
        SamplingParams,
        ScheduledSeq,
        StepPlan,
        StepResult,
        TokenizedRequest,
    )
    from kvflow.shared.telemetry import traceparent

    rids = [f"r{i}" for i in range(batch)]
    core = types.SimpleNamespace(requests=set(rids))  # what the hooks read of the core
    sched = SchedulerTelemetry(core, "m", "s0", lambda: True)  # type: ignore[arg-type]
    for rid in rids:
        tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        headers = {"traceparent": tp} if traced else None
        sched.on_request(TokenizedRequest(rid, "x", [1] * 32, SamplingParams()), headers)
    worker = WorkerTelemetry("w0")
    news = [
        NewRequest(rid, SamplingParams(), 32, traceparent=traceparent(sched.live[rid].span))
        for rid in rids
    ]
    prefill = StepPlan(0, [ScheduledSeq(r, [1] * 32, 0, [0, 1]) for r in rids], news)
    plans = [prefill] + [
        StepPlan(s, [ScheduledSeq(r, [1], 31 + s, [0, 1, 2]) for r in rids])
        for s in range(1, steps + 1)
    ]
    t_sched = t_worker = 0.0
    for plan in plans:
        result = StepResult("w0", plan.step_id, rids, [7] * batch, [0] * batch, batch)
        t0 = time.perf_counter()
        sched.on_plan("w0", plan)
        sched.on_result(plan, result, [])
        t1 = time.perf_counter()
        worker.step_done(plan, result, worker.step_started(plan))
        t2 = time.perf_counter()
        if plan.step_id:  # decode steps only
            t_sched += t1 - t0
            t_worker += t2 - t1
    for rid in rids:
        sched.on_abort(rid, FinishReason.LENGTH)
        worker.step_started(StepPlan(steps + 1, [], finished_request_ids=[rid]))
    return {
        "batch": batch,
        "traced": traced,
        "worker_us_per_step": t_worker / steps * 1e6,
        "scheduler_us_per_step": t_sched / steps * 1e6,
    }


async def _round(base: str, streams: int, max_tokens: int, traced: bool) -> tuple[float, float]:
    """(output tokens/s, median time per output token) of ``streams`` concurrent streams."""

    async def one(client: httpx.AsyncClient) -> tuple[int, float]:
        headers = (
            {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
            if traced
            else {}
        )
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        t0 = time.perf_counter()
        first, tokens = None, 0
        async with client.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    tokens += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
        return tokens, (end - (first or t0)) / max(1, tokens - 1)

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client) for _ in range(streams)))
        wall = time.perf_counter() - t0
    return sum(t for t, _ in res) / wall, statistics.median(tp for _, tp in res)


def _e2e(rounds: int, streams: int, max_tokens: int) -> dict:
    from kvflow.cli.traces import OtlpReceiver

    rx = OtlpReceiver().start()
    port = free_port()
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/health", proc, "kvflow serve")
        asyncio.run(_round(base, 2, 8, False))  # warm-up
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for i in range(rounds * 2):
            traced = i % 2 == 1
            runs[traced].append(asyncio.run(_round(base, streams, max_tokens, traced)))
            print(f"round {i + 1}: traced={traced} {runs[traced][-1][0]:.1f} tok/s", flush=True)
        time.sleep(2)  # the last batch of spans
        spans = rx.store.all_spans()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        rx.stop()
    out = {}
    for traced, rs in runs.items():
        key = "traced" if traced else "untraced"
        out[f"{key}_tok_s"] = statistics.median(r[0] for r in rs)
        out[f"{key}_tpot_ms"] = statistics.median(r[1] for r in rs) * 1000
    out["spans_exported"] = len(spans)
    out["traces_exported"] = len({s.trace_id for s in spans if s.name != "step"})
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="bench_tracing", description=__doc__)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--e2e", action="store_true", help="also run kvflow serve, traced vs untraced")
    p.add_argument("--rounds", type=int, default=3, help="e2e rounds of each kind")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    print(
        "per decode step, tracing hooks (µs): batch | worker untraced/traced | scheduler untraced/traced"
    )
    rows = _hooks((1, 16, 64), args.steps)
    for b in (1, 16, 64):
        off = next(r for r in rows if r["batch"] == b and not r["traced"])
        on = next(r for r in rows if r["batch"] == b and r["traced"])
        print(
            f"{b:>5} | {off['worker_us_per_step']:7.1f} / {on['worker_us_per_step']:7.1f} "
            f"| {off['scheduler_us_per_step']:7.1f} / {on['scheduler_us_per_step']:7.1f}"
        )
    if args.e2e:
        r = _e2e(args.rounds, args.streams, args.max_tokens)
        print(
            f"e2e ({args.streams} streams x {args.max_tokens} tokens, median of {args.rounds} "
            f"rounds each): untraced {r['untraced_tok_s']:.1f} tok/s, TPOT "
            f"{r['untraced_tpot_ms']:.0f} ms; traced {r['traced_tok_s']:.1f} tok/s, TPOT "
            f"{r['traced_tpot_ms']:.0f} ms ({r['traced_tok_s'] / r['untraced_tok_s'] - 1:+.1%}); "
            f"{r['traces_exported']} traces, {r['spans_exported']} spans exported"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
