"""``--dtype bfloat16`` on the CPU path: dense linear layers in bf16 through oneDNN
(kernels/cpu_gemm.py ``Bf16Weight``), everything else, the lm_head included, in fp32."""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import LlamaShape, random_llama
from kernels import cpu_gemm
from services.worker.model_setup import CpuPathSpec, DeviceSpec, load_model

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


def test_the_cpu_path_packs_for_its_dtype_and_refuses_float16() -> None:
    assert cpu_gemm.linear_packing(torch.bfloat16) == (cpu_gemm.Bf16Weight, "oneDNN bf16")
    assert cpu_gemm.linear_packing(torch.float32)[0] in (
        cpu_gemm.PanelWeight,
        cpu_gemm.PackedWeight,
    )
    cfg, weights = random_llama(torch.float32, torch.device("cpu"), shape=TINY)
    spec = DeviceSpec("cpu", torch.bfloat16)
    loaded = load_model(None, spec, CpuPathSpec(gemm_rows=None), config=cfg, weights=weights)
    model = loaded.model
    assert loaded.gemm == "oneDNN bf16" and model.dtype == torch.float32
    assert isinstance(model.layers[0]["qkv"], cpu_gemm.Bf16Weight)
    assert not isinstance(model.lm_head, cpu_gemm.Bf16Weight)  # fp32 logits
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_model(None, DeviceSpec("cpu", torch.float16), CpuPathSpec(), cfg, weights)
