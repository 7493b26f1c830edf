"""The garbage collector in a long-running service. What a service built while starting
(imported modules, the model, the tokenizer, the app) lives as long as the process, yet every
full collection scanned all of it again: 100-300 ms pauses with torch and transformers loaded,
several a minute under load, each stalling every stream the process serves. Frozen once the
service is ready, those objects are out of the collector's way (vLLM freezes its heap after
start-up too), and a larger youngest generation leaves the per-step garbage (decoded messages,
deltas) to reference counting instead of promoting it."""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger("kvflow.heap")

# containers allocated between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now to the permanent generation, which no
    collection scans; call it when the service is ready, before serving."""
    gc.collect()
    gc.freeze()
    # back to a generation the collector sees before the interpreter tears modules down: left
    # frozen, native objects (tokenizers, the tracer's exporters) were released after the
    # modules they need, and two services exited with SIGSEGV after a clean drain
    atexit.register(gc.unfreeze)
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    log.debug("heap frozen: %d objects", gc.get_freeze_count())
