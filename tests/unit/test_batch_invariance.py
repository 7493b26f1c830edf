"""Calibration of the GEMM row layout: what it chooses must really keep every row's bits
independent of the batch, checked on fresh inputs through the worker's own ``linear``."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as K
from kernels.batch_invariance import CANDIDATE_PADS, calibrate


def test_calibrated_layout_is_batch_invariant_on_fresh_rows() -> None:
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(96, 64, generator=g), torch.randn(64, 160, generator=g)]
    rows = calibrate(weights, max_rows=32)
    assert rows.invariant
    assert rows.pad in (*CANDIDATE_PADS,) and rows.tile % rows.pad == 0
    for w in weights:
        x = torch.randn(45, w.shape[1], generator=g)
        full = K.linear(x, w, K.RowLayout(45, (), rows.tile, rows.pad))
        torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-4)
        for n in (1, 2, 3, 5, 17, 32, 33):
            idx = torch.randperm(45, generator=g)[:n]
            part = K.linear(x[idx], w, K.RowLayout(n, (), rows.tile, rows.pad))
            assert torch.equal(part, full[idx]), n


def test_max_rows_must_hold_whole_fallback_tiles() -> None:
    with pytest.raises(ValueError):
        calibrate([torch.randn(8, 8)], max_rows=20)
