"""The native CPU layer ops (kernels/csrc/layer_ops_cpu.c) against the PyTorch reference
(kernels/reference.py): RMSNorm with the residual add, RoPE with the KV-cache write,
SiLU-and-multiply and GELU(tanh)-and-multiply; their batch invariance and their input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import cpu_layer_ops as L
from kvflow.kernels import cpu_native
from kvflow.kernels import reference as K

# Only a missing compiler skips; a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler: the worker uses the PyTorch path"
)


def test_the_kernels_build_and_load() -> None:
    assert L.available()


@pytest.mark.parametrize("n", [576, 64, 37])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_reference(n: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(n)
    x, r = torch.randn(7, n, generator=g) * 3, torch.randn(7, n, generator=g)
    w = torch.randn(n, generator=g)
    want, want_r = K.rms_norm(x, w, 1e-5, r.clone() if with_residual else None)
    got, got_r = L.add_rms_norm(x, w, 1e-5, r.clone() if with_residual else None)
    assert torch.equal(got_r, want_r)  # the residual sum is one exact IEEE add
    # another summation order for mean(x^2): at most a couple of ulps apart
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-7)


def test_rms_norm_updates_the_residual_in_place_and_reads_strided_rows() -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 200, generator=g)
    x = wide[:, :96]  # rows 200 apart
    r = torch.randn(4, 96, generator=g)
    w = torch.rand(96, generator=g)
    want, want_r = K.rms_norm(x, w, 1e-6, r.clone())
    got, got_r = L.add_rms_norm(x, w, 1e-6, r)
    assert got_r is r and torch.equal(r, want_r)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-7)


def test_silu_and_mul_matches_the_reference_over_the_whole_range() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 2 * 300, generator=g) * 20  # far into both tails
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 87.5, -90.0])
    want, got = K.silu_and_mul(x), L.silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_gelu_tanh_and_mul_matches_torch_and_the_reference() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 2 * 300, generator=g) * 3
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e20, -1e20])
    gate, up = x[:, :300], x[:, 300:]
    got = L.gelu_tanh_and_mul(x)
    torch.testing.assert_close(got, K.gelu_tanh_and_mul(x), rtol=1e-6, atol=1e-30)
    # F.gelu's 1 + tanh(y) loses ~1e-7 of |g| for g < 0 (cancellation): an absolute floor
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(up.abs().max()))
    gd = gate.double()
    exact = 0.5 * gd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd**3)))
    # against the exact value: fp32's rounding of y (~6e-8 |2y| relative in exp(-2y)) grows
    # with |g| in the negative tail, so the comparison stops at |g| < 6 (|2y| < 25)
    near = gate.abs() < 6
    torch.testing.assert_close(
        got.double()[near], (exact * up.double())[near], rtol=5e-6, atol=1e-30
    )
    # strided rows (a column slice of a wider buffer)
    wide = torch.randn(4, 2 * 64 + 5, generator=g)
    torch.testing.assert_close(
        L.gelu_tanh_and_mul(wide[:, :128]), K.gelu_tanh_and_mul(wide[:, :128]), rtol=1e-6, atol=0
    )


def _split(qkv: torch.Tensor, h: int, hkv: int, d: int):  # noqa: ANN202
    t = qkv.shape[0]
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 16), (8, 1, 32)])
def test_rope_and_kv_write_equal_the_reference_bit_for_bit(
    h: int, hkv: int, d: int, dtype: torch.dtype
) -> None:
    """Into an fp32 cache, or a bf16 one (--dtype bfloat16's: K rotated in fp32, then K and V
    rounded to nearest even), the bits the reference write (``.to(dtype)``) stores; ties,
    subnormals, infinities and values near the largest bf16 included."""
    g = torch.Generator().manual_seed(h * d)
    cs = K.build_cos_sin_cache(d, 4096, 10000.0)
    qkv = torch.randn(6, (h + 2 * hkv) * d, generator=g)
    qkv[0, (h + hkv) * d :][:6] = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, 1e-40, float("inf"), 3.39e38, -0.0]
    )
    pos = torch.tensor([0, 5, 100, 4095, 7, 33])
    slots = torch.tensor([3, 17, -1, 159, 40, 0])  # -1: not stored
    kc = torch.randn(10, 16, hkv, d, generator=g).to(dtype)
    vc = torch.randn(10, 16, hkv, d, generator=g).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = _split(qkv, h, hkv, d)
    want_q, want_k = K.rotary_embedding(pos, q, k, cs)
    K.write_kv_cache(want_k, v, kc, vc, slots)
    got_q = L.rope_write_kv(qkv, h, hkv, pos, cs, kc2, vc2, slots)
    assert torch.equal(got_q, want_q)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(kc2.view(bits), kc.view(bits)) and torch.equal(vc2.view(bits), vc.view(bits))
    with pytest.raises(ValueError, match="fp32 or bf16"):  # K and V of one dtype
        L.rope_write_kv(qkv, h, hkv, pos, cs, kc2, vc2.to(torch.float64), slots)


def test_each_row_is_the_same_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(13, 576, generator=g), torch.randn(13, 576, generator=g)
    w = torch.randn(576, generator=g)
    gu = torch.randn(13, 2 * 1536, generator=g) * 4
    big, _ = L.add_rms_norm(x, w, 1e-5, r.clone())
    silu = L.silu_and_mul(gu)
    gelu = L.gelu_tanh_and_mul(gu)
    for i in (0, 6, 12):
        alone, _ = L.add_rms_norm(x[i : i + 1], w, 1e-5, r[i : i + 1].clone())
        assert torch.equal(alone[0], big[i])
        assert torch.equal(L.silu_and_mul(gu[i : i + 1])[0], silu[i])
        assert torch.equal(L.gelu_tanh_and_mul(gu[i : i + 1])[0], gelu[i])


def test_bad_inputs_are_refused() -> None:
    cs = K.build_cos_sin_cache(16, 32, 10000.0)
    qkv = torch.randn(2, 6 * 16)
    kc, vc = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    ok_pos, ok_slots = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="out of range"):
        L.rope_write_kv(qkv, 2, 2, torch.tensor([0, 32]), cs, kc, vc, ok_slots)
    with pytest.raises(ValueError, match="out of range"):
        L.rope_write_kv(qkv, 2, 2, ok_pos, cs, kc, vc, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="heads"):
        L.rope_write_kv(qkv, 3, 2, ok_pos, cs, kc, vc, ok_slots)
    with pytest.raises(ValueError, match="int64"):
        L.rope_write_kv(qkv, 2, 2, ok_pos.int(), cs, kc, vc, ok_slots)
    with pytest.raises(ValueError, match="fp32"):
        L.add_rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="even"):
        L.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even"):
        L.gelu_tanh_and_mul(torch.randn(2, 7))
