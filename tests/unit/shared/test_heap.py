"""shared/heap.py: a ready service collects its youngest generation less often."""

from __future__ import annotations

import gc

from kvflow.shared.heap import YOUNG_THRESHOLD, tune_collector


def test_the_young_threshold_is_raised_and_nothing_is_frozen() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    try:
        tune_collector()
        assert gc.get_threshold() == (max(before[0], YOUNG_THRESHOLD), *before[1:])
        assert YOUNG_THRESHOLD > 700  # CPython's default, which this is meant to raise
        assert gc.get_freeze_count() == frozen
    finally:
        gc.set_threshold(*before)
