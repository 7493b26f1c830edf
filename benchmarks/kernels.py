"""GPU benchmark of the Triton kernels: ``python -m benchmarks.kernels`` (needs a CUDA GPU).

Prints two markdown tables for the GPU it runs on:

1. per kernel: median time (``triton.testing.do_bench``, L2 flushed between runs), the bytes it
   must move at least, the bandwidth that makes and its fraction of the device's measured copy
   bandwidth (a large device-to-device copy, read + write), and the same work done with torch
   beside it (``F.scaled_dot_product_attention`` over K/V gathered from the paged cache, torch
   ops / kernels/reference.py for the rest), with the largest difference between the two;
2. end to end: greedy decode of a random-weight 1B-class Llama (kernels/llama_step.py: hidden
   2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192) over a paged cache at a given
   context, eager and as one CUDA graph per step, in tokens per second.

Table 2 is the kernels' own ceiling: a device-only loop (the next token and the slot mapping
computed on the GPU, no host work between steps). The worker's real decode path (ModelRunner
on StepPlans: host-built metadata copied once per step, CUDA graphs over a batch-size ladder,
sampling, results back to the host) is timed by ``python -m benchmarks.decode
--device cuda --random-llama`` on the same model shape; it lives under services/ because
kernels/ imports nothing from services/ or shared/. The gap between the two is the worker's
per-step overhead.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.ops import KernelBackend

BLOCK_SIZE = 16


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float
    min_bytes: float
    torch_us: float | None
    torch_what: str
    max_diff: float | None
    note: str = ""


def _us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _try_us(fn: Callable[[], object]) -> tuple[float | None, str]:
    """A torch baseline that this torch build cannot run on this GPU gets "n/a", not a crash."""
    try:
        return _us(fn), ""
    except Exception as e:  # noqa: BLE001 - report any failure of a baseline and go on
        return None, f"torch failed: {type(e).__name__}: {str(e)[:80]}"


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (counting the read and the write)."""
    src = torch.ones(1 << 29, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    t = _us(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    return nbytes / (t * 1e-6)


def _paged(
    batch: int, ctx: int, hkv: int, d: int, dtype: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches holding ``batch`` contexts of ``ctx`` tokens in shuffled blocks."""
    nblk = -(-ctx // BLOCK_SIZE)
    shape = (batch * nblk, BLOCK_SIZE, hkv, d)
    k_cache = torch.randn(shape, dtype=dtype, device=dev)
    v_cache = torch.randn(shape, dtype=dtype, device=dev)
    tables = torch.randperm(batch * nblk, device=dev).view(batch, nblk).to(torch.int32)
    return k_cache, v_cache, tables


def _gather(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] from the paged cache: what a torch implementation has to do first."""
    b = tables.shape[0]
    g = cache[tables.long()]  # [B, nblk, block_size, Hkv, D]
    return g.view(b, -1, *cache.shape[2:])[:, :ctx].transpose(1, 2)


def bench_decode(
    ops: KernelBackend,
    batch: int,
    ctx: int,
    h: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> Row:
    k_cache, v_cache, tables = _paged(batch, ctx, hkv, d, dtype, dev)
    q = torch.randn(batch, h, d, dtype=dtype, device=dev)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = d**-0.5

    def run_triton() -> torch.Tensor:
        return ops.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)

    def run_torch() -> torch.Tensor:
        k, v = _gather(k_cache, tables, ctx), _gather(v_cache, tables, ctx)
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
        return o[:, :, 0]

    out = run_triton()
    torch_us, note = _try_us(run_torch)
    diff = _diff(out, run_torch()) if torch_us is not None else None
    if torch_us is not None:
        k, v = (
            _gather(k_cache, tables, ctx).contiguous(),
            _gather(v_cache, tables, ctx).contiguous(),
        )
        sdpa_us, _ = _try_us(
            lambda: F.scaled_dot_product_attention(
                q[:, :, None], k, v, scale=scale, enable_gqa=True
            )
        )
        if sdpa_us is not None:
            note = f"SDPA alone on pre-gathered K/V: {sdpa_us:.1f} us"
    esize = k_cache.element_size()
    nbytes = 2 * batch * ctx * hkv * d * esize + 2 * batch * h * d * esize + tables.numel() * 4
    return Row(
        "decode_attention",
        f"B={batch} ctx={ctx} H={h} Hkv={hkv} D={d}",
        _us(run_triton),
        nbytes,
        torch_us,
        "gather + SDPA",
        diff,
        note,
    )


def bench_extend(
    ops: KernelBackend,
    batch: int,
    prefix: int,
    new: int,
    h: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> Row:
    ctx = prefix + new
    k_cache, v_cache, tables = _paged(batch, ctx, hkv, d, dtype, dev)
    q = torch.randn(batch * new, h, d, dtype=dtype, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * new
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = d**-0.5

    def run_triton() -> torch.Tensor:
        return ops.extend_attention(q, k_cache, v_cache, tables, seq_lens, qsl, new, scale)

    def run_torch() -> torch.Tensor:
        qb = q.view(batch, new, h, d).transpose(1, 2)
        k, v = _gather(k_cache, tables, ctx), _gather(v_cache, tables, ctx)
        if prefix == 0:
            o = F.scaled_dot_product_attention(
                qb, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # new tokens after a cached prefix: bottom-right aligned causal mask
            from torch.nn.attention.bias import causal_lower_right

            rep = h // hkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(
                qb, k, v, attn_mask=causal_lower_right(new, ctx), scale=scale
            )
        return o.transpose(1, 2).reshape(batch * new, h, d)

    out = run_triton()
    torch_us, note = _try_us(run_torch)
    diff = _diff(out, run_torch()) if torch_us is not None else None
    t_us = _us(run_triton)
    keys_seen = new * prefix + new * (new + 1) // 2  # per sequence and head, causal
    flops = 4 * batch * h * d * keys_seen
    esize = k_cache.element_size()
    nbytes = 2 * q.numel() * esize + 2 * batch * ctx * hkv * d * esize
    note = note or f"{flops / (t_us * 1e-6) / 1e12:.0f} TFLOP/s (compute bound)"
    what = "gather + SDPA causal" if prefix == 0 else "gather + SDPA lower-right mask"
    shape = f"B={batch} prefix={prefix} new={new} H={h} Hkv={hkv} D={d}"
    return Row("extend_attention", shape, t_us, nbytes, torch_us, what, diff, note)


def bench_write_kv(
    ops: KernelBackend, t: int, hkv: int, d: int, dtype: torch.dtype, dev: torch.device
) -> Row:
    k_cache, v_cache, _ = _paged(1, 4 * t, hkv, d, dtype, dev)
    k = torch.randn(t, hkv, d, dtype=dtype, device=dev)
    v = torch.randn(t, hkv, d, dtype=dtype, device=dev)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=dev)[:t]
    k2, v2 = k_cache.clone(), v_cache.clone()

    def run_torch() -> None:
        k2.view(-1, hkv, d).index_copy_(0, slots, k)
        v2.view(-1, hkv, d).index_copy_(0, slots, v)

    def run_triton() -> None:
        ops.write_kv_cache(k, v, k_cache, v_cache, slots)

    run_triton()
    torch_us, note = _try_us(run_torch)
    diff = max(_diff(k_cache, k2), _diff(v_cache, v2)) if torch_us is not None else None
    nbytes = 4 * t * hkv * d * k.element_size() + t * 8
    return Row(
        "write_kv_cache",
        f"T={t} Hkv={hkv} D={d}",
        _us(run_triton),
        nbytes,
        torch_us,
        "index_copy_",
        diff,
        note,
    )


def bench_rms_norm(
    ops: KernelBackend, t: int, n: int, dtype: torch.dtype, dev: torch.device
) -> Row:
    from kernels import reference

    x = torch.randn(t, n, dtype=dtype, device=dev)
    r = torch.randn(t, n, dtype=dtype, device=dev)
    w = torch.randn(n, dtype=dtype, device=dev)
    out = ops.rms_norm(x, w, 1e-5, r)[0]
    torch_us, note = _try_us(lambda: reference.rms_norm(x, w, 1e-5, r))
    diff = _diff(out, reference.rms_norm(x, w, 1e-5, r)[0]) if torch_us is not None else None
    return Row(
        "rms_norm + residual",
        f"T={t} N={n}",
        _us(lambda: ops.rms_norm(x, w, 1e-5, r)),
        4 * t * n * x.element_size() + n * w.element_size(),
        torch_us,
        "reference (torch ops)",
        diff,
        note,
    )


def bench_rotary(
    ops: KernelBackend, t: int, h: int, hkv: int, d: int, dtype: torch.dtype, dev: torch.device
) -> Row:
    from kernels import reference

    cos_sin = reference.build_cos_sin_cache(d, 8192, 500000.0, dtype).to(dev)
    positions = torch.randint(0, 8192, (t,), device=dev)
    q = torch.randn(t, h, d, dtype=dtype, device=dev)
    k = torch.randn(t, hkv, d, dtype=dtype, device=dev)
    out = ops.rotary_embedding(positions, q, k, cos_sin)
    torch_us, note = _try_us(lambda: reference.rotary_embedding(positions, q, k, cos_sin))
    diff = None
    if torch_us is not None:
        ref = reference.rotary_embedding(positions, q, k, cos_sin)
        diff = max(_diff(out[0], ref[0]), _diff(out[1], ref[1]))
    esize = q.element_size()
    nbytes = 2 * t * (h + hkv) * d * esize + t * d * esize + t * 8
    return Row(
        "rotary_embedding",
        f"T={t} H={h} Hkv={hkv} D={d}",
        _us(lambda: ops.rotary_embedding(positions, q, k, cos_sin)),
        nbytes,
        torch_us,
        "reference (torch ops)",
        diff,
        note,
    )


def bench_silu(
    ops: KernelBackend, t: int, inter: int, dtype: torch.dtype, dev: torch.device
) -> Row:
    x = torch.randn(t, 2 * inter, dtype=dtype, device=dev)

    def run_torch() -> torch.Tensor:
        return F.silu(x[:, :inter]) * x[:, inter:]

    out = ops.silu_and_mul(x)
    torch_us, note = _try_us(run_torch)
    diff = _diff(out, run_torch()) if torch_us is not None else None
    return Row(
        "silu_and_mul",
        f"T={t} I={inter}",
        _us(lambda: ops.silu_and_mul(x)),
        3 * t * inter * x.element_size(),
        torch_us,
        "F.silu(gate) * up",
        diff,
        note,
    )


def kernel_table(
    ops: KernelBackend, copy_bw: float, dtype: torch.dtype, dev: torch.device
) -> list[str]:
    from kernels.llama_step import LlamaShape

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
    ]
    lines = [
        "| kernel | shape | triton us | GB/s | % of copy BW | torch us | torch does | speedup "
        "| max abs diff | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bw = r.min_bytes / (r.triton_us * 1e-6)
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
    from kernels import llama_step
    from kernels.triton_decode_attention import default_num_splits

    shape = llama_step.LlamaShape()
    weights = llama_step.random_llama(shape, dtype, dev)
    warmup = 3
    max_len = context + warmup + steps + 1
    nblk = -(-max_len // BLOCK_SIZE)
    caches = llama_step.make_kv_caches(shape, batch * nblk, BLOCK_SIZE, dtype, dev)
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
        inputs = llama_step.StepInputs(
            tokens, positions, slots, tables, seq_lens, num_splits=splits
        )
        logits = llama_step.forward(ops, shape, weights, caches, inputs)
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
) -> list[str]:
    from kernels.llama_step import LlamaShape

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

    from kernels.ops import get_backend

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
    if not args.skip_kernels:
        print("\n".join(kernel_table(ops, copy_bw, dtype, dev)), flush=True)
        print()
    if not args.skip_e2e:
        print(
            "\n".join(e2e_table(ops, args.batches, args.context, args.steps, copy_bw, dtype, dev))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
