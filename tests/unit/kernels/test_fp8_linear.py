"""fp8 weights (kernels/fp8_linear.py) through ``torch._scaled_mm``: on a GPU, cuBLASLt's fp8
GEMM (which writes bf16), else torch's CPU fallback (row-wise scales need torch 2.13): the
product is that of the dequantized e4m3 operands, per-channel and per-token scales keep each
row's own range, fusion keeps each row's scale, and what cuBLASLt cannot take is refused."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.fp8_linear import FP8, FP8_MAX, Fp8Weight, quantize_fp8, quantize_rows

# the device users run fp8 on where there is one (the CPU path refuses fp8; its runs are tests')
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# cuBLASLt's row-wise fp8 GEMM writes bf16 (8 significant bits); the CPU fallback writes fp32
RTOL = 1e-5 if DEV == "cpu" else 1e-2


def _w(n: int = 96, k: int = 64, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.2
    return w.to(DEV)


def test_product_is_that_of_the_dequantized_operands_and_near_the_dense_one() -> None:
    w = _w()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(DEV)
    fw = Fp8Weight.quantize(w)
    assert fw.q.dtype == FP8 and fw.scale.shape == (1, 96) and fw.nbytes == 96 * 64 + 96 * 4
    xq, xs = quantize_rows(x)
    emulated = (xq.float() * xs).double() @ fw.dequantize().double().T
    torch.testing.assert_close(fw(x).double(), emulated, rtol=RTOL, atol=RTOL)
    dense = x @ w.T
    assert (fw(x) - dense).abs().max() <= 0.06 * dense.abs().max()  # e4m3: 3 mantissa bits


def test_scales_follow_each_row_and_a_zero_row_stays_zero() -> None:
    w = _w()
    w[5] *= 1000.0  # one output channel far larger than the rest
    w[6] = 0.0
    fw = Fp8Weight.quantize(w)
    deq = fw.dequantize()
    rel = ((deq - w).abs().amax(dim=1) / w.abs().amax(dim=1).clamp(min=1e-30))[:5]
    assert bool((rel <= 2**-3).all())  # the others keep their own precision
    assert bool((deq[6] == 0).all()) and bool(torch.isfinite(deq).all())
    assert float(fw.q.float().abs().max()) <= FP8_MAX
    x = torch.zeros(3, 64, device=DEV)
    x[1] = torch.randn(64, device=DEV) * 1e4  # per-token scales: a huge row next to zero rows
    y = fw(x)
    assert bool((y[0] == 0).all()) and bool((y[2] == 0).all()) and bool(torch.isfinite(y).all())


def test_fused_weights_keep_each_rows_scale() -> None:
    a, b = Fp8Weight.quantize(_w(32, 64, 1)), Fp8Weight.quantize(_w(48, 64, 2) * 50)
    fused = Fp8Weight.cat([a, b])
    x = torch.randn(4, 64, device=DEV)
    assert fused.shape == (80, 64)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], dim=1), rtol=RTOL, atol=RTOL)


def test_what_cublaslt_cannot_take_is_refused_and_only_linear_layers_are_quantized() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Weight.quantize(torch.randn(10, 64, device=DEV))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        Fp8Weight.quantize(_w())(torch.randn(2, 32, device=DEV))
    assert Fp8Weight.quantize(_w())(torch.zeros(0, 64, device=DEV)).shape == (0, 96)
    weights = {
        "model.embed_tokens.weight": _w(),
        "model.layers.0.mlp.up_proj.weight": _w(),
        "model.layers.0.input_layernorm.weight": torch.ones(64, device=DEV),
        "lm_head.weight": _w(),
    }
    out = quantize_fp8(weights, frozenset({"up_proj"}))
    assert isinstance(out["model.layers.0.mlp.up_proj.weight"], Fp8Weight)
    assert all(isinstance(out[n], torch.Tensor) for n in weights if "up_proj" not in n)
