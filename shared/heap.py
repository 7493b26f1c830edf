"""The garbage collector in a long-running service. A service allocates containers on every
step (decoded messages, deltas, plans) that reference counting frees at once; CPython still
collects its youngest generation every 700 net allocations, and the collections those steps set
off (and the full ones they lead to, which scan every object the service built at start-up:
torch, transformers, the tokenizer, the app) were a sixth of the gateway's time at 256 streams.
Every service process (kvflow/cli/main.py, before the service starts) collects the youngest
generation every ``YOUNG_THRESHOLD`` allocations instead: the per-step garbage dies by reference
count before a collection sees it.

The start-up heap is not frozen (``gc.freeze``): with it, two services of the compose stack
exited with SIGSEGV after a clean drain, three runs of four."""

from __future__ import annotations

import gc

# containers allocated between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 10_000


def tune_collector() -> None:
    """Collect the youngest generation every ``YOUNG_THRESHOLD`` allocations (never more
    often than the interpreter was set to)."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
