"""``--quantization w8a8``'s products on the CPU (kernels/csrc/quant_matmul_cpu.c
``kvf_quant_matmul_int8``): activations rounded to int8 per block of 32 exactly as specified,
products equal to the same math in float64, a row's bits independent of the batch, the AVX2
(maddubs) build equal bit for bit to this CPU's own (VNNI where it has it), and the error against
fp32 activations small."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvflow.kernels import cpu_native, cpu_quant

pytestmark = pytest.mark.skipif(
    not cpu_quant.panel_available(), reason="the int8 kernel needs AVX2 (elsewhere: exact path)"
)
TYPES = {"Q8_0": GGMLQuantizationType.Q8_0, "Q4_0": GGMLQuantizationType.Q4_0}


def weight(qtype: str, n: int, k: int, seed: int = 0) -> cpu_quant.QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = quantize(w, TYPES[qtype])
    qw = cpu_quant.QuantWeight.from_gguf(raw, int(TYPES[qtype]), (n, k))
    return dataclasses.replace(qw, int8_activations=True)


def test_rows_are_rounded_per_block_of_32() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    xq, xd = cpu_quant.quantize_rows_int8(x)
    blocks = x.view(5, 3, 32).numpy()
    amax = np.abs(blocks).max(axis=2)
    assert np.array_equal(xd.numpy(), (amax / np.float32(127)).astype(np.float32))
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    want = np.rint(blocks * inv[:, :, None]).astype(np.int8).reshape(5, 96)
    assert np.array_equal(xq.numpy(), want)
    assert xq.abs().max() <= 127


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("k", [64, 96, 576])  # an odd number of blocks included
def test_products_equal_the_int8_math(qtype: str, k: int) -> None:
    n, m = 70, 9
    qw = weight(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3
    y = qw(x).double().numpy()
    xq, xd = cpu_quant.quantize_rows_int8(x)
    wd = qw.dequantize().double().view(n, k // 32, 32)
    raw = qw.blocks.view(n, k // 32, -1)[:, :, :2].numpy().copy()  # each block's fp16 d
    d = torch.from_numpy(raw.view(np.float16).astype(np.float64))[..., 0]
    wq = torch.round(wd / d[:, :, None])  # the block's integers (w = d * q exactly)
    assert torch.equal(wq * d[:, :, None], wd)
    isum = torch.einsum("mbi,nbi->mnb", xq.double().view(m, -1, 32), wq)  # exact integers
    scale = (xd[:, None, :] * d.float()[None, :, :]).double()  # dx * dw in fp32, as the kernel
    want = (isum * scale).sum(dim=2).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_row_gets_the_same_bits_in_any_batch(qtype: str) -> None:
    qw = weight(qtype, 100, 128, seed=3)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(4))
    full = qw(x)
    for i in (0, 3, 37, 69):
        assert torch.equal(qw(x[i : i + 1])[0], full[i])
    assert torch.equal(qw(x[5:11]), full[5:11])


def test_the_avx2_build_gives_this_cpus_bits() -> None:
    """vpdpbusd (AVX-512 VNNI, pairs of blocks per instruction) and AVX2's maddubs + madd (one
    block at a time) must sum the same 4-byte groups into the same lanes."""
    flags = [f for f in cpu_quant._COMPILE_FLAGS if f != "-march=native"] + ["-march=haswell"]
    path = cpu_native.build(cpu_quant._SRC, flags, cache_dir=cpu_native.setup().cache_dir)
    assert path is not None and cpu_native.pool() is not None
    avx2 = ctypes.CDLL(str(path))
    for qtype, k in (("Q8_0", 576), ("Q4_0", 96), ("Q8_0", 32)):
        qw = weight(qtype, 50, k, seed=5)
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(6))
        y = torch.empty(7, 50)
        rc = avx2.kvf_quant_matmul_int8(
            ctypes.c_void_p(x.data_ptr()), 7, k, k, ctypes.c_void_p(qw.blocks.data_ptr()),
            50, qw.qtype, ctypes.c_void_p(y.data_ptr()), 50, 2,
        )  # fmt: skip
        assert rc == 0
        assert torch.equal(y, qw(x)), (qtype, k)


def test_close_to_fp32_activations_and_carried_by_fusing() -> None:
    qw = weight("Q8_0", 256, 576, seed=7)
    exact = dataclasses.replace(qw, int8_activations=False)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(8))
    err = (qw(x) - exact(x)).norm() / exact(x).norm()
    assert 0 < err < 0.015  # rounded (not the exact path), and by ~0.5 %
    fused = cpu_quant.QuantWeight.cat([qw, qw.rows(torch.arange(10))])
    assert fused.int8_activations and torch.equal(fused(x)[:, :256], qw(x))
    with pytest.raises(ValueError, match="int8 activations"):
        cpu_quant.QuantWeight.cat([qw, exact])


def test_only_w8a8_multiplies_with_int8_activations() -> None:
    from kvflow.services.worker.model_loader import round_weights
    from kvflow.services.worker.model_setup import check_quantization

    w = torch.randn(64, 96)
    weights = {"model.layers.0.mlp.down_proj.weight": w, "model.embed_tokens.weight": w}
    out = round_weights(weights, "w8a8")
    assert out["model.layers.0.mlp.down_proj.weight"].int8_activations
    assert out["lm_head.weight"].int8_activations
    exact = round_weights(weights, "int8")  # int8 keeps fp32 activations: exact products
    assert not exact["model.layers.0.mlp.down_proj.weight"].int8_activations
    assert not exact["lm_head.weight"].int8_activations
    cpu = torch.device("cpu")
    assert check_quantization("w8a8", None, cpu, torch.float32) == "w8a8"
    with pytest.raises(ValueError, match="on a GPU use int8"):
        check_quantization("w8a8", None, cpu, torch.float32, backend="triton")
