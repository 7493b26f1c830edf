"""GPU benchmark of the Triton kernels: ``python -m kvflow.benchmarks.kernels`` (needs a CUDA GPU).

Prints two markdown tables for the GPU it runs on:

1. per kernel: median time (``triton.testing.do_bench``, L2 flushed between runs), the bytes it
   must move at least, the bandwidth that makes and its fraction of the device's measured copy
   bandwidth (a large device-to-device copy, read + write), and the same work done with torch
   beside it (``F.scaled_dot_product_attention`` over K/V gathered from the paged cache, torch
   ops / kernels/reference.py for the rest), with the largest difference between the two;
2. end to end: greedy decode of a random-weight 1B-class Llama (the worker's own DecoderModel
   over benchmarks/random_model.py's weights: hidden
   2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192) over a paged cache at a given
   context, eager and as one CUDA graph per step, in tokens per second.

Table 2 is the kernels' own ceiling: a device-only loop (the next token and the slot mapping
computed on the GPU, no host work between steps). The worker's real decode path (ModelRunner
on StepPlans: host-built metadata copied once per step, CUDA graphs over a batch-size ladder,
sampling, results back to the host) is timed by ``python -m kvflow.benchmarks.decode
--device cuda --random-llama`` on the same model shape. The gap between the two is the worker's
per-step overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kvflow.benchmarks.kernel_cases import (
    BLOCK_SIZE,
    bench_decode,
    bench_extend,
    bench_lora,
    bench_rms_norm,
    bench_rotary,
    bench_silu,
    bench_write_kv,
    copy_bandwidth,
)
from kvflow.kernels.ops import KernelBackend


def kernel_table(
    ops: KernelBackend,
    copy_bw: float,
    dtype: torch.dtype,
    dev: torch.device,
    records: list[dict] | None = None,
) -> list[str]:
    """The per-kernel table's markdown lines; each row also appended to ``records`` (a dict
    with ``gbps`` and ``copy_bw_frac`` beside the row's fields), when given."""
    from kvflow.benchmarks.random_model import LlamaShape

    s = LlamaShape()
    h, hkv, d = s.heads, s.kv_heads, s.head_dim
    rows = [
        bench_decode(ops, 64, 512, h, hkv, d, dtype, dev),
        bench_decode(ops, 32, 2048, h, hkv, d, dtype, dev),
        bench_decode(ops, 4, 8192, h, hkv, d, dtype, dev),  # few rows: split-K carries it
        bench_decode(ops, 1, 32768, h, hkv, d, dtype, dev),
        bench_extend(ops, 4, 0, 1024, h, hkv, d, dtype, dev),
        bench_extend(ops, 8, 1536, 512, h, hkv, d, dtype, dev),
        bench_write_kv(ops, 64, hkv, d, dtype, dev),
        bench_write_kv(ops, 4096, hkv, d, dtype, dev),
        bench_rms_norm(ops, 64, s.hidden, dtype, dev),
        bench_rms_norm(ops, 4096, s.hidden, dtype, dev),
        bench_rotary(ops, 4096, h, hkv, d, dtype, dev),
        bench_silu(ops, 4096, s.intermediate, dtype, dev),
        # LoRA of the fused QKV projection, rank 16: a decode batch over 4 adapters, a prefill
        bench_lora(ops, 64, s.hidden, (h + 2 * hkv) * d, 3 * 16, 4, dtype, dev),
        bench_lora(ops, 4096, s.hidden, (h + 2 * hkv) * d, 3 * 16, 4, dtype, dev),
    ]
    lines = [
        "| kernel | shape | triton us | GB/s | % of copy BW | torch us | torch does | speedup "
        "| max abs diff | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw = r.min_bytes / (r.triton_us * 1e-6)
        if records is not None:
            records.append(asdict(r) | {"gbps": bw / 1e9, "copy_bw_frac": bw / copy_bw})
        torch_us = "n/a" if r.torch_us is None else f"{r.torch_us:.1f}"
        speedup = "n/a" if r.torch_us is None else f"{r.torch_us / r.triton_us:.2f}x"
        diff = "n/a" if r.max_diff is None else f"{r.max_diff:.3g}"
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.triton_us:.1f} | {bw / 1e9:.0f} | "
            f"{100 * bw / copy_bw:.0f}% | {torch_us} | {r.torch_what} | {speedup} | {diff} "
            f"| {r.note} |"
        )
    return lines


def decode_throughput(
    ops: KernelBackend,
    batch: int,
    context: int,
    steps: int,
    use_graph: bool,
    dtype: torch.dtype,
    dev: torch.device,
) -> tuple[float, float]:
    """Greedy decode of ``steps`` tokens for ``batch`` sequences that already hold ``context``
    tokens (random K/V: the prompt's values do not change the work). Returns (ms per step,
    bytes a step must read at least)."""
    from kvflow.benchmarks.random_model import LlamaShape, random_llama
    from kvflow.kernels.triton_decode_attention import default_num_splits
    from kvflow.services.worker.model import DecoderModel
    from kvflow.services.worker.step_inputs import DeviceBatch

    shape = LlamaShape()
    model = DecoderModel(*random_llama(dtype, dev, shape=shape))
    warmup = 3
    max_len = context + warmup + steps + 1
    nblk = -(-max_len // BLOCK_SIZE)
    caches = model.make_kv_caches(batch * nblk, BLOCK_SIZE)
    for k_cache, v_cache in caches:
        k_cache.normal_()
        v_cache.normal_()
    tables = torch.randperm(batch * nblk, device=dev).view(batch, nblk).to(torch.int32)
    tables_long = tables.long()
    tokens = torch.randint(0, shape.vocab, (batch,), device=dev)
    positions = torch.full((batch,), context, dtype=torch.long, device=dev)
    seq_lens = torch.empty(batch, dtype=torch.int32, device=dev)
    # fixed for the whole run (a CUDA graph replays one grid): sized from the table's capacity
    splits = default_num_splits(
        batch, shape.kv_heads, shape.heads // shape.kv_heads, nblk * BLOCK_SIZE, dev
    )

    def step() -> None:
        # everything on the device, so the same code can be captured into a CUDA graph
        blocks = tables_long.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0]
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        seq_lens.copy_(positions + 1)
        inputs = DeviceBatch(tokens, positions, slots, tables, seq_lens, None, 1, None, splits)
        logits = model.forward_device(ops, inputs, caches)
        tokens.copy_(logits.argmax(-1))
        positions.add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles every kernel before any capture
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    run = step
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    positions.fill_(context)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    esize = torch.finfo(dtype).bits // 8
    avg_ctx = context + steps / 2
    kv_bytes = batch * avg_ctx * shape.layers * 2 * shape.kv_heads * shape.head_dim * esize
    # every weight once, except the embedding table, of which a step reads only B rows
    weight_bytes = (shape.num_params() - shape.vocab * shape.hidden) * esize
    return ms, weight_bytes + kv_bytes


def e2e_table(
    ops: KernelBackend,
    batches: list[int],
    context: int,
    steps: int,
    copy_bw: float,
    dtype: torch.dtype,
    dev: torch.device,
    records: list[dict] | None = None,
) -> list[str]:
    """The device-only decode loop's markdown lines, a row per batch size (each also appended to
    ``records``, when given)."""
    from kvflow.benchmarks.random_model import LlamaShape

    s = LlamaShape()
    lines = [
        f"Random-weight Llama: hidden {s.hidden}, {s.layers} layers, {s.heads} heads, "
        f"{s.kv_heads} KV heads, intermediate {s.intermediate}, vocab {s.vocab} "
        f"({s.num_params() / 1e9:.2f} B params), block size {BLOCK_SIZE}, greedy, {steps} steps.",
        "",
        "| batch | context | eager ms/step | graph ms/step | tokens/s (graph) | min bytes/step "
        "| % of copy BW (graph) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        eager_ms, nbytes = decode_throughput(ops, b, context, steps, False, dtype, dev)
        gc.collect()
        torch.cuda.empty_cache()
        graph_ms, _ = decode_throughput(ops, b, context, steps, True, dtype, dev)
        gc.collect()  # the runs' weights, caches and graph pool, before the next batch size
        torch.cuda.empty_cache()
        bw = nbytes / (graph_ms * 1e-3)
        if records is not None:
            records.append(
                {"batch": b, "context": context, "eager_ms": eager_ms, "graph_ms": graph_ms}
                | {"tokens_per_s": b / graph_ms * 1e3, "copy_bw_frac": bw / copy_bw}
            )
        lines.append(
            f"| {b} | {context} | {eager_ms:.2f} | {graph_ms:.2f} | {b / graph_ms * 1e3:.0f} "
            f"| {nbytes / 1e9:.2f} GB | {100 * bw / copy_bw:.0f}% |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton kernel and decode benchmark (CUDA).")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). "
            "Without one, check the kernels' correctness with "
            "`pytest tests/kernels` (Triton's interpreter on the CPU).",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "benchmarks/kernels.py times compiled kernels: unset TRITON_INTERPRET", file=sys.stderr
        )
        return 2
    import triton

    from kvflow.kernels.ops import get_backend

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    ops = get_backend("triton")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(dev)
    print(f"## kvflow Triton kernels on {torch.cuda.get_device_name(dev)}")
    print()
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, {args.dtype}; "
        f"device-to-device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)"
    )
    print()
    out: dict = {"device": torch.cuda.get_device_name(dev), "dtype": args.dtype}
    out |= {"copy_bw_gbps": copy_bw / 1e9, "kernels": [], "e2e": []}
    if not args.skip_kernels:
        print("\n".join(kernel_table(ops, copy_bw, dtype, dev, out["kernels"])), flush=True)
        print()
    if not args.skip_e2e:
        e2e = e2e_table(
            ops, args.batches, args.context, args.steps, copy_bw, dtype, dev, out["e2e"]
        )
        print("\n".join(e2e))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
