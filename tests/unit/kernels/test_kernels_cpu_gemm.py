"""Pre-packed fp32 linear weights (kernels/cpu_gemm.py): the panel kernel against torch's GEMM,
its batch invariance for any row count (nothing to calibrate), and the oneDNN fallback."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cpu_gemm, cpu_native
from kvflow.kernels.batch_invariance import GemmRows, calibrate
from kvflow.kernels.cpu_gemm import PackedWeight, PanelWeight

pytestmark = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler: the worker uses torch's GEMMs"
)


def _needs_panels() -> None:
    if not cpu_gemm.panel_available():
        pytest.skip("the panel kernel needs AVX2, FMA and F16C; the worker uses oneDNN here")


@pytest.mark.parametrize(("n", "k"), [(96, 64), (100, 576), (7, 40), (49, 1)])
def test_panels_compute_x_times_w_transposed(n: int, k: int) -> None:
    _needs_panels()
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g), torch.randn(37, k, generator=g)
    pw = PanelWeight(w)
    assert pw.shape == (n, k)
    for rows in (x[:1], x[:3], x[:4], x):  # the 1-row and 4-row kernels, ragged last groups
        torch.testing.assert_close(pw(rows), rows @ w.T, rtol=1e-4, atol=1e-4)  # sum order
    assert pw(x[:0]).shape == (0, n)


def test_a_rows_bits_never_depend_on_the_rest_of_the_call() -> None:
    _needs_panels()
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(130, 256, generator=g), torch.randn(150, 256, generator=g)
    pw = PanelWeight(w)
    full = pw(x)
    for m in (1, 2, 3, 5, 16, 17, 64, 149):
        idx = torch.randperm(150, generator=g)[:m]
        assert torch.equal(pw(x[idx]), full[idx]), m
    strided = torch.randn(150, 300, generator=g)[:, :256].copy_(x)
    assert torch.equal(pw(strided), full)
    assert calibrate([pw], max_rows=64) == GemmRows(1, 64, True)  # nothing to calibrate


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="2-D fp32"):
        PanelWeight(torch.zeros(4, 4, dtype=torch.float64))
    if cpu_gemm.panel_available():
        with pytest.raises(ValueError, match="fp32"):
            PanelWeight(torch.zeros(4, 8))(torch.zeros(2, 7))


def test_onednn_fallback_computes_the_same_product() -> None:
    if not cpu_gemm.onednn_available():
        pytest.skip("torch was built without oneDNN")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(48, 64, generator=g), torch.randn(9, 64, generator=g)
    torch.testing.assert_close(PackedWeight(w)(x), x @ w.T, rtol=1e-5, atol=1e-5)
