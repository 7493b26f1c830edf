"""GGUF blocks in tiles of 16 outputs, multiplied with int8 activations (kernels/cpu_quant_tiles.py,
csrc/quant_tiles_cpu.c; ``--quantization gguf-a8``): every block type decodes from its tiles
exactly as gguf-py dequantizes its blocks, products equal the same math in float64 when x is
already on the int8 grid (so rounding x changes nothing), x off the grid is rounded as
``kvf_quant_matmul_int8`` rounds it, a row's bits never depend on the batch, and ragged shapes
(N not a multiple of 16) work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvflow.kernels import cpu_quant, cpu_quant_tiles
from tests.helpers.kquants import UNIT_TYPES, random_blocks

pytestmark = pytest.mark.skipif(
    not cpu_quant_tiles.available(), reason="tiles need AVX-512 VNNI (elsewhere: the blocks)"
)
TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, **UNIT_TYPES}


def blocks(name: str, n: int, k: int, seed: int = 0) -> cpu_quant.QuantWeight:
    qtype = TYPES[name]
    if qtype in UNIT_TYPES.values():
        return random_blocks(qtype, n, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.1
    return cpu_quant.QuantWeight.from_gguf(quantize(w, GGMLQuantizationType(qtype)), qtype, (n, k))


def on_grid(m: int, k: int, seed: int) -> torch.Tensor:
    """x whose every group of 32 is int8 values (one of them +-127) times a power of two: the
    kernel's rounding returns these values exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g)
    q[:, :, 0] = 127 * (torch.randint(0, 2, (m, k // 32), generator=g) * 2 - 1)
    scale = 2.0 ** torch.randint(-8, 2, (m, k // 32, 1), generator=g)
    return (q * scale).float().reshape(m, k)


@pytest.mark.parametrize("name", TYPES)
def test_tiles_decode_as_gguf_dequantizes(name: str) -> None:
    k = 512
    qw = blocks(name, 37, k)
    tiled = cpu_quant_tiles.TiledQuantWeight.from_blocks(qw)
    want = dequantize(qw.blocks.numpy(), GGMLQuantizationType(qw.qtype)).reshape(37, k)
    assert np.array_equal(tiled.dequantize().numpy(), want)
    ids = torch.tensor([[36, 0], [17, 17]])
    assert torch.equal(tiled[ids], torch.from_numpy(want)[ids])
    with pytest.raises(ValueError, match="out of range"):
        tiled[torch.tensor([37])]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", [16, 45])
def test_products_on_the_int8_grid_equal_float64(name: str, n: int) -> None:
    k = 768 if TYPES[name] in (12, 13, 14) else 96
    qw = blocks(name, n, k, seed=1)
    tiled = cpu_quant_tiles.TiledQuantWeight.from_blocks(qw)
    x = on_grid(13, k, seed=2)
    want = x.double() @ qw.dequantize().double().T
    got = tiled(x).double()
    # float(int sum) * dx * s per group, one rounding each, then the sums over groups
    tol = 1e-6 * (x.double().abs() @ qw.dequantize().double().abs().T)
    assert ((got - want).abs() <= tol + 1e-30).all()


def test_off_the_grid_x_is_rounded_as_the_int8_kernel_rounds_it() -> None:
    qw = blocks("Q6_K", 40, 512, seed=3)  # no min: every term uses the rounded x
    tiled = cpu_quant_tiles.TiledQuantWeight.from_blocks(qw)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(4)) * 3
    xq, xd = cpu_quant.quantize_rows_int8(x)
    rounded = (xq.double().view(6, -1, 32) * xd.double()[:, :, None]).view(6, 512)
    want = rounded @ qw.dequantize().double().T
    tol = 1e-6 * (rounded.abs() @ qw.dequantize().double().abs().T)
    assert ((tiled(x).double() - want).abs() <= tol).all()
    exact = x.double() @ qw.dequantize().double().T
    err = ((tiled(x).double() - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.02  # rounded, by about half a percent


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "Q8_0", "Q4_1"])
def test_a_row_gets_the_same_bits_in_any_batch(name: str) -> None:
    k = 512
    tiled = cpu_quant_tiles.TiledQuantWeight.from_blocks(blocks(name, 70, k, seed=5))
    x = torch.randn(29, k, generator=torch.Generator().manual_seed(6))
    full = tiled(x)
    for i in (0, 7, 15, 28):
        assert torch.equal(tiled(x[i : i + 1])[0], full[i])
    assert torch.equal(tiled(x[3:9]), full[3:9])  # a six: a four and a two
    assert torch.equal(tiled(x[1::2]), full[1::2])  # strided rows


def test_rows_past_a_block_and_tiles_past_a_chunk_get_the_same_bits() -> None:
    # past 256 rows the product runs in blocks of 256 rows by chunks of 16 tiles (256 outputs):
    # 600 rows are three blocks (the last ragged), 300 outputs two chunks (the last ragged)
    tiled = cpu_quant_tiles.TiledQuantWeight.from_blocks(blocks("Q5_1", 300, 64, seed=7))
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(8))
    full = tiled(x)
    for i in (0, 255, 256, 511, 512, 599):
        assert torch.equal(tiled(x[i : i + 1])[0], full[i])
    assert torch.equal(tiled(x[250:262]), full[250:262])
    want = x.double() @ tiled.dequantize().double().T
    assert ((full.double() - want).norm() / want.norm()).item() < 0.02


def test_pack_keeps_blocks_it_cannot_tile_and_refuses_bad_x() -> None:
    z = cpu_quant.QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), cpu_quant.Q4_Z, (4, 32))
    assert cpu_quant_tiles.pack(z) is z  # GPTQ/AWQ's groups have their own zero points
    tiled = cpu_quant_tiles.pack(blocks("Q8_0", 4, 64))
    assert isinstance(tiled, cpu_quant_tiles.TiledQuantWeight)
    assert tiled(torch.zeros(0, 64)).shape == (0, 4)
    with pytest.raises(ValueError, match="fp32"):
        tiled(torch.zeros(2, 32))


def test_gguf_a8_marks_the_files_blocks_and_is_a_cpu_scheme() -> None:
    from kvflow.services.worker.model_loader import round_weights
    from kvflow.services.worker.model_setup import check_quantization
    from kvflow.shared.model_source import ModelSource

    qw = blocks("Q4_K", 16, 256)
    dense = torch.zeros(4, 4)
    out = round_weights({"a": qw, "norm": dense}, "gguf-a8")
    assert out["a"].int8_activations and out["a"].blocks is qw.blocks and out["norm"] is dense
    assert not qw.int8_activations  # the loaded weight itself is left as it was
    cpu = torch.device("cpu")
    gguf = ModelSource("gguf", Path("m.gguf"), "m")
    assert check_quantization("gguf-a8", gguf, cpu, torch.float32) == "gguf-a8"
    with pytest.raises(ValueError, match="on a GPU use gguf"):
        check_quantization("gguf-a8", gguf, cpu, torch.float32, backend="triton")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        check_quantization("gguf-a8", ModelSource("hf", Path("d"), "d"), cpu, torch.float32)
