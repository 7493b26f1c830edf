"""The kernel cases of ``python -m kvflow.benchmarks.kernels``: each times one Triton kernel at
one shape against the same work done with torch, and returns a ``Row`` of the first table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvflow.kernels.ops import KernelBackend

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
    from kvflow.kernels import reference

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
    from kvflow.kernels import reference

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


def bench_lora(
    ops: KernelBackend,
    t: int,
    k: int,
    n: int,
    r: int,
    slots: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> Row:
    """``lora_shrink`` then ``lora_expand`` (one projection's LoRA delta) for ``t`` rows spread
    round robin over ``slots`` adapters, against torch's loop over the adapters (gather, two
    GEMMs, index_add_): the multi-LoRA step cost (Punica's BGMV/SGMV)."""
    from kvflow.kernels import reference

    x = torch.randn(t, k, dtype=dtype, device=dev)
    a = torch.randn(slots, r, k, dtype=dtype, device=dev) / k**0.5
    b = torch.randn(slots, n, r, dtype=dtype, device=dev) / r**0.5
    idx = (torch.arange(t, device=dev) % slots).to(torch.int32)
    out = torch.zeros(t, n, dtype=dtype, device=dev)

    def run(lib) -> torch.Tensor:  # noqa: ANN001
        lib.lora_expand(lib.lora_shrink(x, a, idx), b, idx, out)
        return out

    got = run(ops).clone()
    out.zero_()
    torch_us, note = _try_us(lambda: run(reference))
    out.zero_()
    diff = _diff(got, run(reference)) if torch_us is not None else None
    esize = x.element_size()
    nbytes = (t * (k + 2 * n) + slots * r * (k + n)) * esize
    return Row(
        "lora_shrink + lora_expand",
        f"T={t} K={k} N={n} R={r} S={slots}",
        _us(lambda: run(ops)),
        nbytes,
        torch_us,
        "loop over adapters (gather, 2 GEMMs, index_add_)",
        diff,
        note,
    )
