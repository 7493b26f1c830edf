"""What the planner (planner.py) decides for one worker's step, as plain data that the worker's
WorkerState applies (worker_state.py) and the router (router.py) helps decide: which running
sequences compute how many tokens with which drafts, which are preempted, in what order, and
which waiting sequences are admitted with which admission and where they decode. Nothing here
changes anything."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.services.scheduler.block_manager import BlockHash
from kvflow.services.scheduler.sequence import Sequence
from kvflow.services.scheduler.speculation import Drafts, Proposal


@dataclass(slots=True)
class Run:
    """A sequence's share of the step: ``num_new`` tokens from position ``start`` (known ones,
    then a placeholder for each token a plan in flight samples, then ``drafts``), ``need``
    fresh blocks for them, whether it samples after them, and whether they fill a block (whose
    hash is registered when the plan is applied)."""

    seq: Sequence
    start: int
    num_new: int
    sample: bool
    need: int = 0
    drafts: Drafts | None = None
    fills: bool = False


@dataclass(slots=True)
class Preempt:
    """``seq`` gives its blocks back (recompute) before the runs after it take theirs."""

    seq: Sequence


@dataclass(slots=True)
class RunningDecision:
    """What the running sequences do in the step. ``actions`` are what changes the worker's
    blocks, in the order to apply them (a preemption frees what the runs after it take);
    ``runs`` the sequences that run, in plan order (a victim taken out again); ``proposals``
    every draft proposal consulted (each spends or starts its sequence's proposer state);
    ``budget`` the tokens left; ``admit`` whether waiting sequences may join (not after a
    preemption, nor while one waits for blocks); ``must_sync`` that one waits for blocks
    until the plans in flight are back."""

    actions: list[Run | Preempt]
    runs: dict[Sequence, Run]
    proposals: list[tuple[Sequence, Proposal]]
    budget: int
    admit: bool
    must_sync: bool


@dataclass(slots=True)
class Admission:
    """How a waiting sequence fits on a worker: the cached prefix blocks it reuses, the
    hashes of the next blocks a KV tier holds (loaded instead of computed), the fresh blocks it
    needs and the tokens it computes in this step (none while a tier load fills its blocks)."""

    cached: list[int]
    tier: list[BlockHash]
    need: int
    num_new: int
    count_prefix: bool  # a prefix-cache lookup (not for sequences computing their whole prompt)


@dataclass(frozen=True, slots=True)
class Route:
    """Where an admitted sequence decodes: here (``decode`` None) or on worker ``decode``,
    whose blocks are reserved for it when the admission is applied."""

    decode: str | None = None


@dataclass(slots=True)
class Admit:
    """Admit ``seq`` with ``admission``, to decode as ``route`` says."""

    seq: Sequence
    admission: Admission
    route: Route
