"""Which LoRA adapters a worker holds in memory, and the one rule for what a step evicts.

A worker holds at most ``--max-loras`` adapters, least recently used first. Its adapter cache
(services/worker/lora.py) keeps the weights in this order; the scheduler keeps one per worker
(services/scheduler/worker_state.py), fed with the adapters of the plans it sends, to prefer a
worker that already holds a request's adapter. Both use this class, so the order and the
eviction rule are one and the same on the two sides."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable


class LoraResidency:
    """Adapter names held, least recently used first, at most ``capacity`` (at least 1)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._names: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def names(self) -> list[str]:
        """The adapters held, least recently used first."""
        return list(self._names)

    def use(self, name: str, keep: Collection[str] = ()) -> list[str]:
        """``name`` runs now and becomes the most recently used. One not held takes a place:
        while every place is taken, the least recently used adapter not in ``keep`` (the other
        adapters of the same step) is evicted. Returns the evicted names, oldest first (none
        when every held adapter is kept: a step holds all it runs)."""
        if name in self._names:
            self._names.move_to_end(name)
            return []
        evicted: list[str] = []
        while len(self._names) >= self.capacity:
            old = next((n for n in self._names if n not in keep), None)
            if old is None:
                break
            del self._names[old]
            evicted.append(old)
        self._names[name] = None
        return evicted

    def step(self, names: Iterable[str]) -> list[str]:
        """A step runs ``names`` (repeats allowed): each is used in the order of its first
        appearance, none evicting another of the step. Returns the evicted names."""
        ordered = list(dict.fromkeys(names))
        keep = set(ordered)
        evicted: list[str] = []
        for name in ordered:
            evicted += self.use(name, keep)
        return evicted

    def forget(self, name: str) -> None:
        """``name`` is not held any more (unloaded)."""
        self._names.pop(name, None)
