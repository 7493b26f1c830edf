"""Calibration of the GEMM row layout: what it chooses must really keep every row's bits
independent of the batch, checked on fresh inputs through the worker's own ``linear``."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import reference as K
from kvflow.kernels.batch_invariance import CANDIDATE_PADS, calibrate


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


def test_the_cache_answers_the_same_calibration_and_only_that_one(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from kvflow.kernels import batch_invariance as bi

    weights = [torch.randn(32, 16), torch.randn(16, 48)]
    rows, cached = bi.calibrate_cached(weights, tmp_path, max_rows=32)
    assert not cached and rows == calibrate(weights, max_rows=32)

    def no_calibration(*args: object) -> bi.GemmRows:
        raise AssertionError("calibrated again")

    monkeypatch.setattr(bi, "calibrate", no_calibration)
    assert bi.calibrate_cached([torch.randn(32, 16), torch.randn(16, 48)], tmp_path, 32) == (
        rows,
        True,
    )
    key = bi.cache_key(weights, 32, 0)
    assert bi.cache_key([torch.randn(32, 16)], 32, 0) != key  # other shapes
    assert bi.cache_key(weights, 64, 0) != key  # other parameters
    monkeypatch.setattr(torch, "get_num_threads", lambda: 99)
    assert bi.cache_key(weights, 32, 0) != key  # other thread count


def test_a_damaged_or_unwritable_cache_is_skipped(tmp_path) -> None:  # noqa: ANN001
    from kvflow.kernels import batch_invariance as bi

    weights = [torch.randn(16, 16)]
    path = tmp_path / "gemm-rows" / f"{bi.cache_key(weights, 16, 0)}.json"
    path.parent.mkdir()
    path.write_text("{not json")
    rows, cached = bi.calibrate_cached(weights, tmp_path, max_rows=16)
    assert not cached and rows.tile == 16
    assert bi.calibrate_cached(weights, tmp_path, max_rows=16) == (rows, True)  # rewritten
    (tmp_path / "file").write_text("")  # a file where the folder should be
    assert bi.calibrate_cached(weights, tmp_path / "file", max_rows=16) == (rows, False)


def test_kernels_invariant_by_construction_are_not_cached(tmp_path) -> None:  # noqa: ANN001
    """Their tile is the kernel's own ``max_invariant_rows``: a stale entry (an older kernel's
    smaller tile) must not outlive the kernel that wrote it."""
    from kvflow.kernels import batch_invariance as bi
    from kvflow.kernels.cpu_quant import PANEL_ROWS, QuantWeight

    qw = QuantWeight(torch.zeros(8, 34, dtype=torch.uint8), 8, (8, 32))
    path = tmp_path / "gemm-rows" / f"{bi.cache_key([qw], 64, 0)}.json"
    path.parent.mkdir()
    path.write_text('{"pad": 1, "tile": 16, "invariant": true}')
    assert bi.calibrate_cached([qw], tmp_path, max_rows=64) == (
        bi.GemmRows(1, PANEL_ROWS, True),
        False,
    )
