"""``--dtype bfloat16`` on the CPU path: dense linear layers (and the lm_head) in kvflow's bf16
panels where the CPU has AVX-512 (kernels/cpu_gemm.py ``Bf16PanelWeight``: AVX512_BF16's
vdpbf16ps, or the same products emulated with fp32 fmas), else the layers through oneDNN
(``Bf16Weight``) and the head in fp32; everything else in fp32."""

from __future__ import annotations

import pytest
import torch

from kvflow.benchmarks.random_model import LlamaShape, random_llama
from kvflow.kernels import cpu_gemm
from kvflow.services.worker.model_setup import CpuPathSpec, DeviceSpec, load_model

TINY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256)


def test_products_are_bf16_products_with_fp32_sums() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g)
    bw = cpu_gemm.Bf16Weight(w)
    y = bw(x)
    exact = x.bfloat16().double() @ w.bfloat16().double().T  # the rounded operands' product
    assert y.dtype == torch.float32 and bw.nbytes == 96 * 64 * 2
    torch.testing.assert_close(y.double(), exact, rtol=8e-3, atol=8e-3)  # output in bf16
    assert (y - x @ w.T).norm() / (x @ w.T).norm() < 1e-2


@pytest.mark.skipif(
    not cpu_gemm.bf16_panel_native(),
    reason="without AVX512_BF16 oneDNN's bf16 GEMM converts to fp32 and its row bits depend on "
    "M; the worker runs bf16 panels here, or calibrates its row layout (batch_invariance.py)",
)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)])  # SmolLM2's
def test_a_rows_bits_do_not_depend_on_the_batch(shape: tuple[int, int]) -> None:
    """What the worker's row layout relies on: every 1..8-row GEMM gives each row the bits the
    same row gets among 64 (the one-row case included, which oneDNN alone gets wrong)."""
    g = torch.Generator().manual_seed(1)
    bw = cpu_gemm.Bf16Weight(torch.randn(*shape, generator=g))
    for _ in range(20):
        x = torch.randn(64, shape[1], generator=g)
        full = bw(x)
        for m in range(1, 9):
            assert torch.equal(bw(x[:m]), full[:m]), m


PANELS = pytest.mark.skipif(
    not cpu_gemm.bf16_panel_available(), reason="this CPU has no AVX512_BF16 (oneDNN bf16 runs)"
)
SHAPES = [(960, 576), (576, 1536), (3072, 576), (100, 33), (17, 2), (33, 7)]  # SmolLM2's, ragged


@PANELS
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_panels_are_bf16_products_with_fp32_sums(shape: tuple[int, int]) -> None:
    """Every output is the rounded operands' exact product up to fp32 summation (not rounded
    to bf16), for every row count: the 8-row, 4-, 2- and 1-row kernels and the 4-tile row."""
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g), torch.randn(70, k, generator=g)
    bw = cpu_gemm.Bf16PanelWeight(w)
    assert bw.nbytes == -(-n // 32) * 32 * (k + k % 2) * 2
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    for m in (1, 3, 5, 8, 13, 70):
        y = bw(x[:m])
        assert y.dtype == torch.float32 and y.shape == (m, n)
        bound = 2 * k * 2**-24 * (x[:m].abs().double() @ w.abs().double().T) + 1e-30
        assert ((y.double() - exact[:m]).abs() <= bound).all(), m
    strided = torch.randn(6, 2 * k, generator=g)[:, :k]  # rows with a stride of their own
    assert torch.equal(bw(strided), bw(strided.contiguous()))


@PANELS
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_panels_give_a_row_the_same_bits_in_any_batch(shape: tuple[int, int]) -> None:
    """Batch invariant by construction: a row's bits do not depend on how many rows share the
    call or where it sits among them (nothing for the worker to calibrate)."""
    n, k = shape
    g = torch.Generator().manual_seed(7)
    bw = cpu_gemm.Bf16PanelWeight(torch.randn(n, k, generator=g))
    assert bw.batch_invariant
    x = torch.randn(130, k, generator=g)
    full = bw(x)
    for m in range(1, 20):
        idx = torch.randperm(130, generator=g)[:m]
        assert torch.equal(bw(x[idx]), full[idx]), m
    for j in range(0, 130, 9):
        assert torch.equal(bw(x[j : j + 1]), full[j : j + 1])


def test_bf16_panels_refuse_what_they_cannot_multiply() -> None:
    with pytest.raises(ValueError, match="2-D"):
        cpu_gemm.Bf16PanelWeight(torch.ones(4))
    bw = cpu_gemm.Bf16PanelWeight(torch.ones(8, 6))
    with pytest.raises(ValueError, match=r"fp32 \[M, 6\]"):
        bw(torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"fp32 \[M, 6\]"):
        bw(torch.ones(2, 6, dtype=torch.float64))


def test_the_cpu_path_packs_for_its_dtype_and_refuses_float16() -> None:
    panels = cpu_gemm.bf16_panel_available()
    kind = cpu_gemm.Bf16PanelWeight if panels else cpu_gemm.Bf16Weight
    assert cpu_gemm.linear_packing(torch.bfloat16) == (
        kind,
        "bf16 panels" if panels else "oneDNN bf16",
    )
    assert cpu_gemm.linear_packing(torch.float32)[0] in (
        cpu_gemm.PanelWeight,
        cpu_gemm.PackedWeight,
    )
    cfg, weights = random_llama(torch.float32, torch.device("cpu"), shape=TINY)
    spec = DeviceSpec("cpu", torch.bfloat16)
    loaded = load_model(None, spec, CpuPathSpec(gemm_rows=None), config=cfg, weights=weights)
    model = loaded.model
    assert loaded.gemm == cpu_gemm.linear_packing(torch.bfloat16)[1]
    assert model.dtype == torch.float32
    assert isinstance(model.layers[0].qkv, kind)
    # the logits are fp32 sums: bf16 panels, or fp32 beside oneDNN (which rounds its outputs)
    assert isinstance(model.lm_head, kind if panels else cpu_gemm.linear_packing(torch.float32)[0])
    assert model.kv_dtype == torch.bfloat16  # the KV cache follows --dtype
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in model.make_kv_caches(4, 16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_model(None, DeviceSpec("cpu", torch.float16), CpuPathSpec(), cfg, weights)
