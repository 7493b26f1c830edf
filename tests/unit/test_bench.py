"""Bench workload and accounting (offline; the bench itself is run by hand, not in the suite)."""

from __future__ import annotations

import pytest

from services.bench import make_workload
from services.bench_client import RequestStats, percentile, summarize


def test_workload_is_deterministic_and_within_bounds(tokenizer) -> None:
    a = make_workload(tokenizer, 20, seed=3, prompt_len=(10, 300), max_tokens=(32, 256))
    b = make_workload(tokenizer, 20, seed=3, prompt_len=(10, 300), max_tokens=(32, 256))
    c = make_workload(tokenizer, 20, seed=4, prompt_len=(10, 300), max_tokens=(32, 256))
    assert a == b and a != c
    assert all(10 <= len(p) <= 300 and 32 <= n <= 256 for p, n in a)


def test_percentile_picks_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 51.0  # index round(49.5) = 50 (round half to even)
    assert percentile(xs, 99) == 99.0
    assert percentile([2.0], 99) == 2.0


def test_static_batch_accounting_counts_useful_tokens_only() -> None:
    # two requests in one batch that ran 10 s to its longest request; prefill took 1 s
    stats = [RequestStats(1.0, 10.0, 50), RequestStats(1.0, 10.0, 100)]
    s = summarize("hf-static-2", 2, stats, 10.0)
    assert s.output_tokens == 150 and s.output_tokens_per_s == pytest.approx(15.0)
    assert s.ttft_p50_s == 1.0
    assert s.tpot_p50_s == pytest.approx(9.0 / 99)  # (10 - 1) s over 99 later tokens
    assert s.tpot_p99_s == pytest.approx(9.0 / 49)
