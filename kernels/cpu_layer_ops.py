"""The elementwise parts of a Llama layer on the CPU as one native call each
(``csrc/layer_ops_cpu.c``): RMSNorm with its residual add, RoPE with the KV-cache write,
SiLU-and-multiply and GELU(tanh)-and-multiply.

At decode batch sizes these are a few thousand floats per layer, and the PyTorch reference
(kernels/reference.py) spends its time dispatching ~70 small ops per layer rather than
computing. Same math and op order as the reference (HF's), fp32, batch invariant (each row by
the same instructions whatever the batch); results may differ from PyTorch's in the last bit
(another summation order in RMSNorm's mean, a polynomial ``exp``). ``available()`` is False
where no C compiler is found or native kernels are off (``cpu_native.NativeSetup``); callers
then use the reference.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kvflow.kernels import cpu_native

_SRC = Path(__file__).parent / "csrc" / "layer_ops_cpu.c"
_COMPILE_FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    f"-I{cpu_native.CSRC}",
    "-fPIC",
    "-c",
]


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built or native kernels are off."""
    lib = cpu_native.load_kernels(_SRC, _COMPILE_FLAGS)
    if lib is None:
        return None
    p, i, f, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.kvf_add_rms_norm.argtypes = [p, i, p, i, p, p, i, i, f, i]
    lib.kvf_rope_write_kv.argtypes = [p, i, i, i, i, i, p, p, i, p, p, p, p, lg, i, i]
    lib.kvf_silu_mul.argtypes = [p, i, i, i, p, i]
    lib.kvf_gelu_tanh_mul.argtypes = [p, i, i, i, p, i]
    for fn in (
        lib.kvf_add_rms_norm,
        lib.kvf_rope_write_kv,
        lib.kvf_silu_mul,
        lib.kvf_gelu_tanh_mul,
    ):
        fn.restype = i
    return lib


def available() -> bool:
    return load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the native layer kernels are not available (see the log for why)")
    return lib


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what} must be fp32 [T, N] with unit column stride")


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.rms_norm``: normalise ``x + residual`` (or ``x``) and return it with that sum.
    ``residual`` is updated in place (it is the layer stack's running sum); without one, ``x``
    itself is the new residual."""
    _check_rows(x, "x")
    t, n = x.shape
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{n}]")
    if residual is None:
        residual = x if x.is_contiguous() else x.contiguous()
        has = 0
    else:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError("residual must be contiguous and shaped like x")
        has = 1
    out = torch.empty(t, n, dtype=torch.float32)
    rc = _lib().kvf_add_rms_norm(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr(),
        has,
        weight.data_ptr(),
        out.data_ptr(),
        t,
        n,
        eps,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError("kvf_add_rms_norm refused its arguments")
    return out, residual


def rope_write_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """From a fused QKV projection ``qkv`` [T, (H + 2 Hkv) D]: returns the rotated queries
    [T, H, D] and stores the rotated keys and the values into the caches [num_blocks,
    block_size, Hkv, D] (fp32, or bf16: rounded to nearest even) at ``slot_mapping`` [T] (int64
    flat slots, -1: not stored), as ``reference.rotary_embedding`` then
    ``reference.write_kv_cache`` do."""
    _check_rows(qkv, "qkv")
    t = qkv.shape[0]
    d = cos_sin.shape[1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads")
    for c in (k_cache, v_cache):
        if (
            c.dtype not in (torch.float32, torch.bfloat16)
            or c.dtype != k_cache.dtype
            or not c.is_contiguous()
            or c.shape[2:] != (num_kv_heads, d)
        ):
            raise ValueError(
                "the KV caches must be contiguous fp32 or bf16 [blocks, block_size, Hkv, D]"
            )
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    if positions.shape != (t,) or slot_mapping.shape != (t,) or not cos_sin.is_contiguous():
        raise ValueError("positions / slot_mapping / cos_sin do not fit the tokens")
    pos, slots = positions.contiguous(), slot_mapping.contiguous()
    q = torch.empty(t, num_heads, d, dtype=torch.float32)
    rc = _lib().kvf_rope_write_kv(
        qkv.data_ptr(),
        t,
        qkv.stride(0),
        num_heads,
        num_kv_heads,
        d,
        pos.data_ptr(),
        cos_sin.data_ptr(),
        cos_sin.shape[0],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k_cache.shape[0] * k_cache.shape[1],
        int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError("a position or a KV-cache slot is out of range")
    if rc != 0:
        raise ValueError("kvf_rope_write_kv refused its arguments")
    return q


def _gated(name: str, x: torch.Tensor) -> torch.Tensor:
    """Run the gate/up kernel ``name`` (``act(x[:, :N]) * x[:, N:]``) on x [T, 2N]."""
    _check_rows(x, "x")
    t, n2 = x.shape
    if n2 % 2:
        raise ValueError("x must have an even number of columns (gate | up)")
    out = torch.empty(t, n2 // 2, dtype=torch.float32)
    rc = getattr(_lib(), name)(
        x.data_ptr(), t, n2 // 2, x.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"{name} refused its arguments")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``reference.silu_and_mul``: ``silu(x[:, :N]) * x[:, N:]`` of x [T, 2N]."""
    return _gated("kvf_silu_mul", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``reference.gelu_tanh_and_mul``: ``gelu_tanh(x[:, :N]) * x[:, N:]`` of x [T, 2N]
    (Gemma's MLP; torch's ``F.gelu(approximate="tanh")``)."""
    return _gated("kvf_gelu_tanh_mul", x)
