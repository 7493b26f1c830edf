"""``kvflow bench llamacpp``: kvflow and llama.cpp's ``llama-server`` on the same GGUF file, one
client, one run.

Each system is started in turn on this machine (never both at once: they would share the
cores) and gets the same requests at each number in flight: random-token prompts of
``--input-len`` tokens (ids drawn uniformly from the tokenizer's ordinary vocabulary with
``--seed``; the same ids for every system), ``--output-len`` output tokens with EOS ignored,
greedy, streamed through ``/v1/completions`` with the prompt as token ids
(benchmarks/client.py measures TTFT and time per output token and counts tokens from the
servers' usage). Each point starts with ``--warmup`` requests that are not counted; no prompt is
sent twice, warm-ups included, so neither server's prefix cache skips a prefill.

Fairness: each server is started once and serves every point, as a deployment would.
llama-server runs with ``-np`` equal to the largest number in flight (one slot per request,
``-c`` = slots x (input + output + 16) so each slot holds one request) and ``-t`` threads
(default: all cores); a slot with no request costs nothing in a step, so the small points are
not slowed by the large ``-np``. kvflow runs each configuration with ``--max-num-seqs`` at least
as large (its default, 64, otherwise) and its own default threads.

llama-server is not a dependency: give ``--llama-server PATH`` (or ``LLAMA_SERVER``), or put
``llama-server`` on PATH. Without it, kvflow runs alone and the output says how to get one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.client import RunSummary, run_load
from benchmarks.llama_server import HOW_TO_GET, find_llama_server, start_llama_server, stop
from benchmarks.serving import start_stack
from shared.model_source import load_tokenizer, resolve_model

REFERENCE = "llama.cpp"


@dataclass(frozen=True)
class Point:
    """One number in flight: its measured prompts and its warm-up prompts (sent together
    before them, 2 tokens each, not counted)."""

    concurrency: int
    prompts: list[list[int]]
    warmup: list[list[int]]


def ordinary_token_ids(vocab_size: int, special: Iterable[int]) -> list[int]:
    """Every id but the special and added ones (BOS, EOS, chat markers)."""
    skip = set(special)
    return [i for i in range(vocab_size) if i not in skip]


def random_prompts(ids: Sequence[int], num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids drawn uniformly from ``ids``, the same for a seed."""
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(num)]


def requests_at(concurrency: int, num_prompts: int | None = None) -> int:
    return num_prompts or max(4 * concurrency, 8)


def plan_points(
    concurrencies: Sequence[int],
    ids: Sequence[int],
    input_len: int,
    seed: int,
    num_prompts: int | None = None,
    warmup: int = 3,
) -> list[Point]:
    """Every point's prompts, all distinct, from one seeded draw: every system gets these."""
    sizes = [(c, requests_at(c, num_prompts), warmup) for c in concurrencies]
    pool = random_prompts(ids, sum(n + w for _, n, w in sizes), input_len, seed)
    points, used = [], 0
    for c, n, w in sizes:
        points.append(Point(c, pool[used + w : used + w + n], pool[used : used + w]))
        used += n + w
    return points


def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """``"gguf=--quantization gguf;fp32="`` -> [("kvflow-gguf", [...]), ("kvflow-fp32", [])]."""
    out = []
    for part in text.split(";"):
        if part.strip():
            name, _, flags = part.partition("=")
            out.append((f"kvflow-{name.strip()}", flags.split()))
    return out


def kvflow_configs(configs: str | None, serve_args: str) -> list[tuple[str, list[str]]]:
    """``--kvflow-configs`` if given, else one kvflow with ``--kvflow-args``."""
    if configs:
        return parse_configs(configs)
    return [(f"kvflow {serve_args}".strip(), serve_args.split())]


def format_table(results: Sequence[RunSummary], reference: str = REFERENCE) -> str:
    """A markdown table, one row per system and number in flight (grouped by the number in
    flight); the last column is output tok/s over the reference's at the same number."""
    ref = {r.concurrency: r for r in results if r.name.split("@")[0] == reference}
    lines = [
        "| system | in flight | requests | output tok/s | req/s | mean latency s | TTFT p50 ms "
        f"| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | tok/s vs {reference} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: r.concurrency):  # stable: systems keep their order
        name, base = r.name.split("@")[0], ref.get(r.concurrency)
        if name == reference:
            ratio = "(ref)"
        else:
            ratio = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r.concurrency} | {r.requests} | {r.output_tokens_per_s:.1f} | "
            f"{r.requests_per_s:.2f} | {r.latency_mean_s:.2f} | {r.ttft_p50_s * 1e3:.0f} | "
            f"{r.ttft_p99_s * 1e3:.0f} | {r.tpot_p50_s * 1e3:.1f} | {r.tpot_p99_s * 1e3:.1f} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def measure(
    base: str, model: str, name: str, points: Sequence[Point], output_len: int
) -> list[RunSummary]:
    results = []
    for p in points:
        workload = [(prompt, output_len) for prompt in p.prompts]
        run = run_load(
            base, model, workload, p.concurrency, name=f"{name}@{p.concurrency}", warmup=p.warmup
        )
        results.append(asyncio.run(run))
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its own flags; --concurrency (1,16,64 here), --input-len (128) and --output-len (64)
    are shared with the pipeline bench (benchmarks/pipeline.py), --seed and --out with
    ``kvflow bench``."""
    p.add_argument("--llama-server", default="", help="llama-server binary (or $LLAMA_SERVER)")
    p.add_argument("--llama-threads", type=int, default=0, help="llama-server -t (0: all cores)")
    p.add_argument(
        "--kvflow-args",
        default="--quantization gguf",
        help="flags for the kvflow serve it starts ('' for fp32 weights)",
    )
    p.add_argument(
        "--kvflow-configs",
        default=None,
        help="several kvflows in turn, NAME=serve flags ';'-separated, e.g. "
        "'gguf=--quantization gguf;int8=--quantization int8' (replaces --kvflow-args)",
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per point (max(4 x in flight, 8))"
    )
    p.add_argument("--warmup", type=int, default=3, help="uncounted requests before each point")


def main(args: argparse.Namespace) -> int:
    src = resolve_model(args.model)
    if src.kind != "gguf":
        raise SystemExit("kvflow bench llamacpp needs a GGUF model (llama-server reads GGUF)")
    input_len, output_len = args.input_len or 128, args.output_len or 64
    concurrencies = [int(x) for x in (args.concurrency or "1,16,64").split(",") if x.strip()]
    tok = load_tokenizer(src)
    ids = ordinary_token_ids(len(tok), [*tok.all_special_ids, *tok.added_tokens_decoder])
    points = plan_points(concurrencies, ids, input_len, args.seed, args.num_prompts, args.warmup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cpu, cores = _cpu_name(), os.cpu_count() or 1
    load = os.getloadavg()[0]
    print(f"CPU: {cpu}, {cores} cores; load average {load:.1f}")
    if load > cores / 2:
        # llama.cpp's threads spin between ops; on a busy machine its figures collapse first
        print("note: other work is running on this machine; its figures will not be fair")
    print(
        f"{src.path.name}: {input_len} random prompt tokens, {output_len} output tokens, greedy, "
        f"EOS ignored, streamed; in flight {concurrencies}, requests "
        f"{[len(p.prompts) for p in points]}, warm-up {[len(p.warmup) for p in points]}"
    )
    results: list[RunSummary] = []
    meta: dict = {"cpu": cpu, "cores": cores, "load_average": load, "model": str(src.path)}
    meta |= {"seed": args.seed, "input_len": input_len, "output_len": output_len}
    meta |= {"concurrency": concurrencies, "warmup": args.warmup}
    binary = find_llama_server(args.llama_server)
    if binary is None:
        named = args.llama_server or os.environ.get("LLAMA_SERVER", "")
        print(
            (f"llama-server: {named} is not an executable. " if named else "")
            + f"llama-server not found; {HOW_TO_GET}. Running kvflow alone."
        )
    else:
        slots = max(concurrencies)
        ctx = slots * (input_len + output_len + 16)
        threads = args.llama_threads or cores
        log = out / f"llama-server-{stamp}.log"
        print(f"starting {binary} -np {slots} -c {ctx} -t {threads} (log: {log}) ...", flush=True)
        proc, base, meta["llama_server"] = start_llama_server(
            binary, src.path, slots, ctx, threads, log
        )
        try:
            results += measure(base, src.name, REFERENCE, points, output_len)
        finally:
            stop(proc)
    meta["kvflow"] = {}
    for name, flags in kvflow_configs(args.kvflow_configs, args.kvflow_args):
        flags = ["--max-num-seqs", str(max(64, *concurrencies)), *flags]
        if "--model" not in flags:  # the file llama-server serves
            flags = ["--model", str(src.path), *flags]
        meta["kvflow"][name] = flags
        print(f"starting kvflow serve {' '.join(flags)} ...", flush=True)
        proc, base = start_stack(flags)
        try:
            results += measure(base, src.name, name, points, output_len)
        finally:
            stop(proc)
    print("\n" + format_table(results))
    for r in results:  # a server that stopped early, or usage missing and chunks merged
        if r.output_tokens != r.requests * output_len:
            print(
                f"note: {r.name} generated {r.output_tokens} tokens, not {r.requests * output_len}"
            )
    path = out / f"llamacpp-{stamp}.json"
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {path}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
