"""``kvflow bench pipeline``: what the pipeline itself costs, with the model taken out.

Starts ``kvflow serve --worker-backend sim`` (the simulated worker: real plans, KV accounting and
messages, no model; services/worker/sim_runner.py), streams completions through the OpenAI API
at several concurrencies (random-token prompts, ``ignore_eos``, a fixed number of output tokens,
as vLLM's ``benchmark_serving.py --dataset-name random`` sends them) and prints, per
concurrency: output tokens/s, TTFT and TPOT percentiles, and the CPU time each process of the
stack spent per output token (utime + stime from /proc, so the figure is independent of how the
2 cores were shared). The client's own CPU is shown too: on a small machine it competes with
the stack for the same cores.

Run: ``kvflow bench pipeline`` (``--sim-step-ms 5`` for a GPU-like step time); figures are
recorded in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from kvflow.benchmarks.client import RequestStats, percentile
from kvflow.benchmarks.stack import start_stack

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class StreamStats(RequestStats):
    itls: list[float] = field(default_factory=list)  # gaps between a request's events


@dataclass
class PipelineRun:
    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    cpu_us_per_token: dict[str, float]  # process name -> CPU us per output token
    kvflow_us_per_token: float  # the kvflow services together (not NATS, Redis or the client)
    # the workers' time in steps over the run's wall time (``kvflow:worker_busy_seconds_total``:
    # the figure a GPU operator watches) and the runner's own mean step
    worker_busy_fraction: float
    worker_step_ms: float


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def stack_processes(root: int) -> dict[str, int]:
    """The processes of a ``kvflow serve`` (its children): name -> pid. Services are named by
    their ``run SERVICE`` argument (numbered when there are several), NATS and Redis by their
    binaries."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != root:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if "run" in argv and argv.index("run") + 1 < len(argv):
            name = argv[argv.index("run") + 1]
        elif any("nats-server" in a for a in argv):
            name = "nats-server"
        elif any("redis-server" in a for a in argv):
            name = "redis-server"
        else:
            continue
        key, i = name, 1
        while key in out:
            i += 1
            key = f"{name}-{i}"
        out[key] = int(entry)
    return out


WORKER_SERIES = (
    "kvflow:worker_busy_seconds_total",
    "kvflow:worker_step_seconds_sum",
    "kvflow:worker_step_seconds_count",
    "kvflow:worker_batch_seqs_sum",
    "kvflow:worker_step_tokens_sum",
)


def worker_series(base: str) -> dict[str, float]:
    """The workers' step series (``WORKER_SERIES``, summed over workers) from the gateway's
    whole-stack ``/metrics``; their change over a run gives the busy fraction (busy seconds over
    wall time), the runner's own mean step time, batch and tokens per step."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(WORKER_SERIES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def random_prompts(num: int, length: int, seed: int, vocab: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(length)] for _ in range(num)]


async def _stream(
    session, url: str, model: str, prompt: list[int], max_tokens: int, stream: bool = True
) -> StreamStats:  # noqa: ANN001
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    start = time.perf_counter()
    if not stream:  # one JSON answer: its latency stands for the first token's and the last's
        async with session.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            tokens = (await r.json())["usage"]["completion_tokens"]
        end = time.perf_counter() - start
        return StreamStats(end, end, tokens, [])
    body["stream_options"] = {"include_usage": True}
    ttft = None
    last = start
    itls: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            if ttft is None:
                ttft = now - start
            else:
                itls.append(now - last)
            last = now
    end = time.perf_counter() - start
    return StreamStats(ttft if ttft is not None else end, end, tokens, itls)


async def run_streams(
    base: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    stream: bool = True,
    warm_up: bool = True,
) -> tuple[list[StreamStats], float]:
    """Send every prompt with at most ``concurrency`` in flight; (per-request stats, seconds).
    ``stream`` False: requests not streamed (their latency in place of TTFT). ``warm_up``: one
    4-token request first, not timed (a caller that reads the stack's counters around the run
    warms up with a call of its own instead, so its counters cover the timed run only)."""
    url = f"{base}/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        if warm_up:
            await _stream(session, url, model, prompts[0], 4)

        async def one(p: list[int]) -> StreamStats:
            async with sem:
                return await _stream(session, url, model, p, max_tokens, stream)

        t0 = time.perf_counter()
        stats = await asyncio.gather(*(one(p) for p in prompts))
        return list(stats), time.perf_counter() - t0


def measure(
    base: str,
    procs: dict[str, int],
    model: str,
    concurrency: int,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    stream: bool = True,
) -> PipelineRun:
    prompts = random_prompts(num_requests, prompt_len, seed, (1000, 40000))
    # one 4-token request first, outside the counters read around the timed run
    asyncio.run(run_streams(base, model, prompts[:1], 4, 1, warm_up=False))
    w0 = worker_series(base)
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    run = run_streams(base, model, prompts, max_tokens, concurrency, stream, warm_up=False)
    stats, dur = asyncio.run(run)
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    after = {name: cpu_seconds(pid) for name, pid in procs.items()}
    w = {n: v - w0[n] for n, v in worker_series(base).items()}
    tokens = sum(s.output_tokens for s in stats)
    per = {n: (after[n] - before[n]) * 1e6 / max(1, tokens) for n in procs}
    client = (me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime) * 1e6 / max(1, tokens)
    per["client"] = client
    kvflow = sum(v for n, v in per.items() if n.split("-")[0] in SERVICES)
    itls = [x for s in stats for x in s.itls]
    return PipelineRun(
        concurrency=concurrency,
        requests=len(stats),
        output_tokens=tokens,
        duration_s=dur,
        output_tokens_per_s=tokens / dur,
        ttft_p50_ms=percentile([s.ttft_s for s in stats], 50) * 1e3,
        ttft_p99_ms=percentile([s.ttft_s for s in stats], 99) * 1e3,
        tpot_p50_ms=percentile([s.tpot_s for s in stats], 50) * 1e3,
        tpot_p99_ms=percentile([s.tpot_s for s in stats], 99) * 1e3,
        itl_p50_ms=percentile(itls, 50) * 1e3,
        cpu_us_per_token=per,
        kvflow_us_per_token=kvflow,
        worker_busy_fraction=w["kvflow:worker_busy_seconds_total"] / dur,
        worker_step_ms=w["kvflow:worker_step_seconds_sum"]
        / max(1.0, w["kvflow:worker_step_seconds_count"])
        * 1e3,
    )


def print_runs(title: str, runs: list[PipelineRun]) -> None:
    print(f"\n{title}")
    print(
        f"{'streams':>7} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'ITL p50':>8} {'kvflow us/tok':>13} {'worker busy':>11} "
        f"{'step':>7}"
    )
    for r in runs:
        print(
            f"{r.concurrency:>7} {r.output_tokens_per_s:>9.0f} {r.ttft_p50_ms:>7.1f}ms "
            f"{r.ttft_p99_ms:>7.1f}ms {r.tpot_p50_ms:>7.2f}ms {r.tpot_p99_ms:>7.2f}ms "
            f"{r.itl_p50_ms:>6.2f}ms {r.kvflow_us_per_token:>13.0f} "
            f"{r.worker_busy_fraction:>11.0%} {r.worker_step_ms:>5.2f}ms"
        )
    names = sorted({n for r in runs for n in r.cpu_us_per_token})
    print("CPU us per output token, by process:")
    print(f"{'streams':>7} " + " ".join(f"{n:>12}" for n in names))
    for r in runs:
        print(f"{r.concurrency:>7} " + " ".join(f"{r.cpu_us_per_token[n]:>12.0f}" for n in names))


def add_arguments(p: argparse.ArgumentParser) -> None:
    # shared with `kvflow bench llamacpp` (other defaults there: None means the tool's own)
    p.add_argument(
        "--concurrency", default=None, help="streams in flight, comma-separated (1,32,256)"
    )
    p.add_argument(
        "--sim-step-ms",
        default="0",
        help="model time per step of the simulated worker; comma-separated for several stacks",
    )
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens, random ids (32)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens, no EOS (256)")
    p.add_argument(
        "--nats-tls",
        choices=("off", "on", "both"),
        default="off",
        help="TLS on every bus connection (a throwaway CA and server certificate made with "
        "trustme, a dev dependency); both: each stack without, then with, as peers",
    )
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="requests not streamed (one JSON answer each; TTFT columns: request latency, TPOT and ITL: none)",
    )
    p.add_argument(
        "--requests-per-stream",
        type=float,
        default=2.0,
        help="requests sent = concurrency x this (at least 8)",
    )


def tls_serve_args() -> list[str]:
    """`kvflow serve` arguments for a TLS bus: a fresh CA and a certificate for 127.0.0.1."""
    import tempfile

    try:
        import trustme
    except ImportError as e:
        raise SystemExit("--nats-tls needs trustme (pip install trustme; in kvflow's [dev])") from e
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = Path(tempfile.mkdtemp(prefix="kvflow-bench-tls-"))
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    return [
        "--nats-server-tls-cert",
        str(d / "server.pem"),
        "--nats-server-tls-key",
        str(d / "server.key"),
        "--nats-tls-ca",
        str(d / "ca.pem"),
    ]


def main(args: argparse.Namespace) -> int:
    from kvflow.shared.model_source import resolve_model

    args.concurrency = args.concurrency or "1,32,256"
    args.input_len = args.input_len or 32
    args.output_len = args.output_len or 256

    model = resolve_model(args.model).name
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    steps = [float(s) for s in args.sim_step_ms.split(",") if s.strip()]
    extra = args.serve_args.split()
    results: dict[str, list[dict]] = {}
    tls_modes = {"off": [False], "on": [True], "both": [False, True]}[args.nats_tls]
    for step_ms, tls in [(s, t) for s in steps for t in tls_modes]:
        serve_args = [
            "--worker-backend",
            "sim",
            "--sim-step-ms",
            str(step_ms),
            "--max-num-seqs",
            str(max(levels)),
            *(tls_serve_args() if tls else []),
            *extra,
        ]
        print(f"starting kvflow serve {' '.join(serve_args)} ...", flush=True)
        proc, base = start_stack(serve_args)
        runs = []
        try:
            procs = stack_processes(proc.pid)
            for c in levels:
                n = max(8, round(c * args.requests_per_stream))
                print(f"  {c} streams: {n} requests x {args.output_len} tokens ...", flush=True)
                runs.append(
                    measure(
                        base,
                        procs,
                        model,
                        c,
                        n,
                        args.input_len,
                        args.output_len,
                        args.seed,
                        not args.no_stream,
                    )
                )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        bus = ", NATS over TLS" if tls else ""
        print_runs(f"simulated worker, {step_ms:g} ms per step{bus} ({platform.machine()})", runs)
        results[f"sim_step_ms={step_ms:g}" + (",tls" if tls else "")] = [asdict(r) for r in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=2))
    print(f"\nwrote {path}")
    return 0
