"""Decode steps of the worker itself: ``python -m kvflow.benchmarks.decode``.

Times ``ModelRunner.execute`` on real StepPlans: ``--batch`` sequences that already hold
``--context`` tokens each decode one greedy token per step (the cache's K/V values do not change
the work a decode step does, so no prefill is run first). Prints, per batch size, the step's
wall time (min and median over ``--steps`` steps after warm-up), the process CPU time of the
cheapest step (with ``--threads 1`` the most robust figure on a machine shared with other work),
and tokens per second.

``--busy N`` runs N busy processes (a Python spin loop each) beside the timed steps, as a serving
machine's other processes are (the gateway, clients, other pods): the figure issue 38 compares
with the quiet step, and with the same step on ``--threads 1``.

- CPU (``--device cpu``): the worker's CPU path (native decode attention, oneDNN-packed GEMMs,
  calibrated batch invariance) on ``--model`` (default: SmolLM2-135M-Instruct).
- GPU (``--device cuda``): the Triton kernels with decode steps replayed as CUDA graphs
  (``--enforce-eager``: eager), on ``--model`` or, with ``--random-llama``, a random-weight
  1B-class Llama (benchmarks/random_model.py's ``LlamaShape``: hidden 2048, 16 layers, 32 heads, 8 KV
  heads, intermediate 8192, vocab 32000).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvflow.benchmarks.random_model import LlamaShape, random_llama
from kvflow.services.worker import machine
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.config import Settings
from kvflow.shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan


def decode_steps(
    runner: ModelRunner, batch: int, context: int, steps: int, warmup: int, first_block: int
) -> tuple[list[float], list[float]]:
    """Run ``warmup + steps`` greedy decode steps of ``batch`` sequences from ``context``
    tokens on; returns the timed steps' wall and process CPU seconds. As a scheduler's plans,
    the first step sends each block table whole and the later ones only what changed
    (nothing: the tables hold every step's blocks from the start)."""
    bs = runner.block_size
    nblk = -(-(context + warmup + steps + 1) // bs)
    blocks = list(range(first_block, first_block + batch * nblk))
    random.Random(batch).shuffle(blocks)
    tables = [blocks[i * nblk : (i + 1) * nblk] for i in range(batch)]
    rids = [f"b{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    new = [NewRequest(r, params, context) for r in rids]
    tokens = [(7 * i + 1) % runner.config.vocab_size for i in range(batch)]
    wall, cpu = [], []
    for k in range(warmup + steps):
        seqs = [
            ScheduledSeq(r, [t], context + k, table)
            if k == 0
            else ScheduledSeq(r, [t], context + k, [], block_table_from=len(table))
            for r, t, table in zip(rids, tokens, tables, strict=True)
        ]
        plan = StepPlan(k, seqs, new)
        t0, c0 = time.perf_counter(), time.process_time()
        res = runner.execute(plan)
        t1, c1 = time.perf_counter(), time.process_time()
        if res.error:
            raise RuntimeError(res.error)
        new = []
        tokens = res.token_ids
        if k >= warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
    runner.execute(StepPlan(warmup + steps, [], [], rids))  # forget the requests
    return wall, cpu


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Decode-step timing of ModelRunner (CPU or CUDA).")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | ...")
    ap.add_argument("--model", default="", help="GGUF file or HF directory (default SmolLM2)")
    ap.add_argument("--random-llama", action="store_true", help="a random 1B-class Llama")
    shape = ap.add_argument_group("--random-llama's shape (default: 1B-class)")
    shape.add_argument("--hidden", type=int, default=0, help="hidden size")
    shape.add_argument("--layers", type=int, default=0, help="decoder layers")
    shape.add_argument("--intermediate", type=int, default=0, help="MLP (each expert's) width")
    shape.add_argument("--experts", type=int, default=0, help="> 0: MoE MLPs of this many")
    shape.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    ap.add_argument(
        "--busy", type=int, default=0, help="busy processes beside the timed steps (default 0)"
    )
    ap.add_argument(
        "--quantization",
        default="",
        help="'' (dense) | gguf | gguf-a8 | int8 | w8a8 | fp8 (CUDA) | gptq | awq",
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", help="auto | bfloat16 | float32 (kvflow serve's)"
    )
    return ap.parse_args(argv)


def _shape(args: argparse.Namespace) -> LlamaShape:
    """``--random-llama``'s shape: the 1B-class default with the given dimensions replaced."""
    changes = {
        k: v
        for k, v in (
            ("hidden", args.hidden),
            ("layers", args.layers),
            ("intermediate", args.intermediate),
            ("experts", args.experts),
        )
        if v
    }
    if args.hidden:  # keep 64-wide heads
        changes |= {"heads": args.hidden // 64, "kv_heads": max(1, args.hidden // 256)}
    return dataclasses.replace(LlamaShape(), **changes, top_k=args.top_k)


def _shape_name(s: LlamaShape) -> str:
    params = s.num_params() / 1e9
    what = f"{s.experts} experts of {s.intermediate}, top-{s.top_k}" if s.experts else "dense"
    return (
        f"random Llama-shaped model ({params:.2f}B parameters: hidden {s.hidden}, {s.layers} "
        f"layers, {what}, {s.active_intermediate} active MLP features per token)"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    machine.configure(Settings.from_env())  # before any kernel loads
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvflow.services.worker.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    bs, max_batch = args.block_size, max(args.batch)
    per_seq = -(-(args.context + args.warmup + args.steps + 1) // bs)
    num_blocks = sum(b * per_seq for b in args.batch) + 1
    max_len = per_seq * bs
    kw: dict = {"quantization": args.quantization} if args.quantization else {}
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if device.type != "cpu":  # (CPU: only arguments every ModelRunner version takes)
        kw |= {
            "device": device,
            "cuda_graphs": False if args.enforce_eager else None,
            "max_num_seqs": max_batch,
        }
    t0 = time.perf_counter()
    if args.random_llama:
        shape = _shape(args)
        if args.quantization in (
            "int8",
            "w8a8",
            "fp8",
        ):  # rounded on the host, as load_weights does
            from kvflow.services.worker.model_loader import round_weights

            cfg, weights = random_llama(torch.float32, torch.device("cpu"), shape=shape)
            weights = {n: w.to(dtype) for n, w in weights.items()}
            weights = round_weights(weights, args.quantization)
        elif args.quantization:
            raise SystemExit("--random-llama takes --quantization int8 or fp8 (no checkpoint)")
        else:
            cfg, weights = random_llama(dtype, device, shape=shape)
        runner = ModelRunner.from_weights(cfg, weights, bs, num_blocks, max_model_len=max_len, **kw)
        name = _shape_name(shape) + (
            f" --quantization {args.quantization}" if args.quantization else ""
        )
    else:
        from kvflow.shared.model_source import resolve_model

        src = resolve_model(args.model)
        runner = ModelRunner.create(src, bs, num_blocks, dtype=dtype, max_model_len=max_len, **kw)
        name = src.name + (f" --quantization {args.quantization}" if args.quantization else "")
    if args.kv_cache_dtype != "auto":
        name += f" --kv-cache-dtype {args.kv_cache_dtype}"
    load_s = time.perf_counter() - t0
    graphs = getattr(runner, "graphs", None)
    path = "cpu" if getattr(runner, "ops", None) is None else "triton"
    if path == "triton":
        path += f", CUDA graphs {graphs.sizes}" if graphs is not None else ", eager"
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    beside = f"; beside {args.busy} busy processes" if args.busy else ""
    print(
        f"## ModelRunner decode steps: {name}, {str(dtype).removeprefix('torch.')} on {what} "
        f"({path}); torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"loaded in {load_s:.1f}s; {args.steps} timed steps after {args.warmup} warm-up{beside}"
    )
    print()
    print("| batch | context | step ms (min) | step ms (median) | CPU ms (min step) | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        rows = _time_batches(runner, args, per_seq)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if args.json:
        out = {"model": name, "dtype": str(dtype).removeprefix("torch."), "device": what}
        out |= {"path": path, "load_s": load_s, "busy": args.busy, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _time_batches(runner: ModelRunner, args: argparse.Namespace, per_seq: int) -> list[dict]:
    """One table row per ``--batch`` size (printed as it comes); their figures."""
    first = 0
    rows = []
    for b in args.batch:
        wall, cpu = decode_steps(runner, b, args.context, args.steps, args.warmup, first)
        first += b * per_seq
        med = statistics.median(wall)
        print(
            f"| {b} | {args.context} | {min(wall) * 1e3:.2f} | {med * 1e3:.2f} | "
            f"{min(cpu) * 1e3:.2f} | {b / med:.0f} |",
            flush=True,
        )
        rows.append(
            {"batch": b, "context": args.context, "min_ms": min(wall) * 1e3}
            | {"median_ms": med * 1e3, "cpu_ms": min(cpu) * 1e3, "tokens_per_s": b / med}
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
