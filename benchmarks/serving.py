"""``kvflow bench``: the whole kvflow pipeline over HTTP against what a user would otherwise run
on the same machine and model (Hugging Face ``generate``, one at a time and in static batches),
on the same requests: mixed prompt lengths, mixed max_tokens, greedy, EOS ignored so every
system does the same work. Prints a table, writes JSON and a PNG chart."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path

from kvflow.benchmarks.client import RunSummary, run_load
from kvflow.benchmarks.stack import start_stack
from kvflow.shared.config import Settings
from kvflow.shared.infra import free_port
from kvflow.shared.model_source import load_tokenizer, resolve_model


def make_workload(
    tokenizer, num: int, seed: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int]
) -> list[tuple[list[int], int]]:
    """Deterministic (prompt token ids, max_tokens) pairs; prompts are slices of real English
    text, so the model sees ordinary input."""
    rng = random.Random(seed)
    words = (
        "the river stone garden lamp winter market letter cloud bridge quiet morning city "
        "train book window light music story friend road sea mountain forest bird"
    ).split()
    text = " ".join(rng.choice(words) for _ in range(4000))
    ids = tokenizer(text)["input_ids"]
    out = []
    for _ in range(num):
        n = rng.randint(*prompt_len)
        start = rng.randint(0, len(ids) - n - 1)
        out.append((ids[start : start + n], rng.randint(*max_tokens)))
    return out


def run_kvflow(url: str | None, model: str, workload, extra: list[str]) -> RunSummary:
    proc = None
    if url is None:
        print("starting kvflow serve ...", flush=True)
        proc, url = start_stack(extra)
    try:
        prompts = [(p, n) for p, n in workload]
        return asyncio.run(run_load(url, model, prompts, len(prompts), name="kvflow"))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


def run_hf_serve(src, tok, workload, cache_dir: Path) -> RunSummary:
    """``transformers serve --continuous-batching`` with the same requests. It takes text
    prompts only and has no ignore_eos, so prompts are sent as their decoded text and its
    throughput counts the tokens it really generated (usage)."""
    from kvflow.benchmarks.hf import export_hf_dir, start_transformers_serve

    model_dir = export_hf_dir(src, cache_dir)
    port = free_port()
    print("starting transformers serve --continuous-batching ...", flush=True)
    proc = start_transformers_serve(model_dir, port)
    try:
        texts = [(tok.decode(p), n) for p, n in workload]
        base = f"http://localhost:{port}"
        return asyncio.run(
            run_load(base, str(model_dir), texts, len(texts), name="hf-serve-cb", ignore_eos=False)
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def chart(results: list[RunSummary], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r.name for r in results]
    a.bar(names, [r.output_tokens_per_s for r in results], color="tab:blue")
    a.set_title("output tokens/s (higher is better)")
    b.bar(names, [r.ttft_p50_s for r in results], color="tab:orange")
    b.set_title("TTFT p50, s (lower is better)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def print_table(results: list[RunSummary]) -> None:
    best_hf = max(
        (r for r in results if r.name != "kvflow"),
        key=lambda r: r.output_tokens_per_s,
        default=None,
    )
    print(
        f"\n{'system':<16}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
    )
    for r in results:
        print(
            f"{r.name:<16}{r.output_tokens_per_s:>9.1f}{r.requests_per_s:>8.2f}"
            f"{r.ttft_p50_s:>10.2f}{r.ttft_p99_s:>10.2f}{r.tpot_p50_s:>10.3f}{r.tpot_p99_s:>10.3f}"
        )
    kv = next((r for r in results if r.name == "kvflow"), None)
    if kv and best_hf:
        ratio = kv.output_tokens_per_s / best_hf.output_tokens_per_s
        print(f"\nkvflow / best baseline ({best_hf.name}): {ratio:.2f}x output tokens/s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``kvflow bench``'s arguments."""
    p.add_argument(
        "what",
        nargs="?",
        choices=[
            "compare",
            "pipeline",
            "quality",
            "llamacpp",
            "peers",
            "embeddings",
            "speculative",
            "lora",
            "tp",
            "chaos",
        ],
        default="compare",
        help="compare (default): kvflow vs Hugging Face; pipeline: the stack with a simulated "
        "worker at several concurrencies, with CPU per token of each service; quality: "
        "perplexity and top-1 agreement of each --quantization against fp32; llamacpp: "
        "kvflow and llama.cpp's llama-server on the same GGUF at 1, 16 and 64 in flight; "
        "peers: the same beside vLLM's CPU build and OpenVINO GenAI too; "
        "embeddings: /v1/embeddings per second, one input per request and batched; "
        "speculative: n-gram speculative decoding against plain decoding (TPOT, tok/s, "
        "acceptance) on quoting and free-form prose workloads; lora: a batch with 0, 1 and "
        "--lora-count distinct LoRA adapters (tok/s, TPOT); tp: one worker at each "
        "--tp-sizes tensor-parallel size (tok/s, TPOT at batch 1 and --tp-batch); chaos: a seeded "
        "stream of faults of every role against a loaded stack, and the invariants that must "
        "hold through it",
    )
    p.add_argument("--url", default=None, help="a running kvflow (default: start one)")
    p.add_argument("--model", default="", help="model path (default: SmolLM2 from the wheel)")
    p.add_argument("--systems", default="kvflow,hf-serve,hf-static-8,hf-static-32,hf-sequential")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--sequential-requests", type=int, default=8, help="hf-sequential runs a subset (slow)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", default="10:300")
    p.add_argument("--max-tokens", default="32:256")
    p.add_argument("--quick", action="store_true", help="a tiny workload, for a smoke test")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--serve-args", default="", help="extra flags for the kvflow serve it starts")
    from kvflow.benchmarks.pipeline import add_arguments

    pipeline = p.add_argument_group("pipeline")
    add_arguments(pipeline)
    from kvflow.benchmarks import quality as bench_quality

    bench_quality.add_arguments(p.add_argument_group("quality"))
    from kvflow.benchmarks import peers as bench_peers

    bench_peers.add_arguments(p.add_argument_group("peers, llamacpp"))
    from kvflow.benchmarks import embeddings as bench_embeddings

    bench_embeddings.add_arguments(p.add_argument_group("embeddings"))
    from kvflow.benchmarks import speculative as bench_speculative

    bench_speculative.add_arguments(p.add_argument_group("speculative"))
    from kvflow.benchmarks import lora as bench_lora

    bench_lora.add_arguments(p.add_argument_group("lora"))
    from kvflow.benchmarks import tensor_parallel as bench_tp

    bench_tp.add_arguments(p.add_argument_group("tp"))
    from kvflow.benchmarks import chaos as bench_chaos

    bench_chaos.add_arguments(p.add_argument_group("chaos"))


def main(args: argparse.Namespace) -> int:
    if args.what == "chaos":
        from kvflow.benchmarks import chaos as bench_chaos

        return bench_chaos.main(args)
    if args.what == "pipeline":
        from kvflow.benchmarks import pipeline as bench_pipeline

        return bench_pipeline.main(args)
    if args.what == "quality":
        from kvflow.benchmarks import quality as bench_quality

        return bench_quality.main(args)
    if args.what in ("peers", "llamacpp"):
        from kvflow.benchmarks import peers as bench_peers

        return bench_peers.main(args)
    if args.what == "embeddings":
        from kvflow.benchmarks import embeddings as bench_embeddings

        return bench_embeddings.main(args)
    if args.what == "speculative":
        from kvflow.benchmarks import speculative as bench_speculative

        return bench_speculative.main(args)
    if args.what == "lora":
        from kvflow.benchmarks import lora as bench_lora

        return bench_lora.main(args)
    if args.what == "tp":
        from kvflow.benchmarks import tensor_parallel as bench_tp

        return bench_tp.main(args)
    return compare(args)


def compare(args: argparse.Namespace) -> int:
    """``kvflow bench`` (compare): kvflow and the Hugging Face systems on the same workload."""
    from kvflow.services.worker import machine

    machine.configure(Settings.from_env())  # before any kernel loads (hf-serve's export)
    cache = machine.cache_dir()
    src = resolve_model(args.model)
    tok = load_tokenizer(src, cache)
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    num, plen, mtok = args.num_requests, span(args.prompt_len), span(args.max_tokens)
    if args.quick:
        num, plen, mtok = 4, (10, 40), (8, 16)
    workload = make_workload(tok, num, args.seed, plen, mtok)
    print(
        f"workload: {num} requests, prompts {plen[0]}-{plen[1]} tokens, max_tokens {mtok[0]}-{mtok[1]}, greedy, EOS ignored"
    )
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    results: list[RunSummary] = []
    if "kvflow" in systems:
        results.append(run_kvflow(args.url, src.name, workload, args.serve_args.split()))
    hf = [s for s in systems if s.startswith("hf-")]
    if "hf-serve" in hf:  # a server of its own: run it before loading the model in-process
        hf.remove("hf-serve")
        results.append(run_hf_serve(src, tok, workload, cache))
    if hf:
        from kvflow.benchmarks.hf import load_hf, static_batches

        print("loading the model in transformers ...", flush=True)
        model = load_hf(src)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        for s in hf:
            if s == "hf-sequential":
                sub = workload[: min(len(workload), 4 if args.quick else args.sequential_requests)]
                print(f"hf-sequential runs the first {len(sub)} requests (one at a time is slow)")
                results.append(static_batches(model, sub, 1, pad, s))
            elif s.startswith("hf-static-"):
                size = len(workload) if s.endswith("all") else int(s.rsplit("-", 1)[1])
                results.append(static_batches(model, workload, size, pad, s))
            else:
                print(f"unknown system {s!r} skipped")
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "workload": {"num": num, "prompt_len": plen, "max_tokens": mtok, "seed": args.seed},
    }
    (out / f"bench-{stamp}.json").write_text(
        json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2)
    )
    if chart(results, out / f"bench-{stamp}.png"):
        print(f"wrote {out}/bench-{stamp}.json and .png")
    return 0
