"""shared/heap.py: a ready service's start-up objects leave the collector's scans and the
youngest generation is collected less often."""

from __future__ import annotations

import gc

from shared.heap import YOUNG_THRESHOLD, freeze_startup_heap


def test_the_start_up_heap_is_frozen_and_the_young_threshold_raised() -> None:
    before = gc.get_threshold()
    kept = [[i] for i in range(1000)]  # objects alive "at start-up"
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (max(before[0], YOUNG_THRESHOLD), *before[1:])
        assert YOUNG_THRESHOLD > 700  # CPython's default, which this is meant to raise
        # a frozen object is in no generation a collection scans
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
