"""A request as the scheduler tracks it: every token so far (prompt + output), how many have
their K/V computed on the worker, and the blocks that hold them. In disaggregated serving a
sequence also holds a reservation of blocks on its decode worker while it is prefilled
elsewhere, and, while its K/V moves there, the prefill worker's blocks (``Transfer``).

Who writes what: the request's own fields are set once, when the core makes the sequence; from
then on every field is written by the WorkerState the sequence is placed on
(worker_state.py: admission, progress, hand-off, requeue, end), the router only asking the
WorkerStates involved. ``Reservation``, ``TierLoad`` and ``Transfer`` never change once made.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from kvflow.services.scheduler.block_manager import BlockHash
from kvflow.services.scheduler.spec_state import SpecState
from kvflow.shared.messages import LoRARef, PoolingParams, SamplingParams

_order = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"  # on its decode worker, waiting for its K/V to arrive
    FINISHED = "finished"


class RequeueReason(enum.Enum):
    """Why a sequence went back to the waiting queue, to be recomputed."""

    PREEMPTED = "preempted"  # memory ran out: the only reason counted as a preemption
    STEP_FAILED = "step failed"  # the worker reported an error or the step was lost
    WORKER_LEFT = "worker left"  # this worker, or the one reserved to decode it, is gone
    TRANSFER_FAILED = "transfer failed"  # its K/V did not arrive from the prefill worker


@dataclass(frozen=True)
class Reservation:
    """Blocks taken on the decode worker at admission, for the K/V of the tokens the prefill
    worker computes; the first ``num_cached`` already hold that prefix (prefix-cache hits
    there), so only the rest are transferred."""

    worker_id: str
    blocks: list[int]
    num_cached: int


@dataclass(frozen=True)
class TierLoad:
    """Blocks of a sequence being filled from the KV tiers: ``blocks`` pairs each fresh block
    with the hash of the content to load, starting at the sequence's block ``first_block``
    (the router names the load and times it)."""

    first_block: int
    blocks: list[tuple[int, bytes]]


@dataclass(frozen=True)
class Transfer:
    """A sequence's K/V on its way from the prefill worker's ``src_blocks`` to the decode
    worker's ``dst_blocks`` (pairwise; blocks the decode worker had cached are not sent)."""

    transfer_id: str
    request_id: str
    src_worker: str
    dst_worker: str
    held_blocks: list[int]  # all of the sequence's blocks on the source, held until the end
    src_blocks: list[int]
    dst_blocks: list[int]
    started: float = 0.0


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: in the root of its block hashes (block_manager.py)
    pooling: PoolingParams | None = None  # an embedding request: prefill only, then finished
    lora: LoRARef | None = None  # its LoRA adapter (its cache_salt then includes the adapter)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    worker_id: str | None = None
    reservation: Reservation | None = None  # decode-worker blocks while prefilled elsewhere
    transfer: Transfer | None = None  # while TRANSFERRING from another worker
    load: TierLoad | None = None  # while TRANSFERRING from the KV tiers
    redis_prefix_blocks: int = 0  # leading full blocks Redis held when the request arrived
    announced: bool = False  # the current worker has had this sequence's NewRequest
    sent_blocks: int = 0  # entries of ``blocks`` the current worker has from the plans sent
    aborted: bool = False  # aborted while its K/V was in flight: freed when the transfer ends
    num_preemptions: int = 0
    spec: SpecState | None = None  # its draft proposer (speculative decoding), once it decodes
    order: int = field(default_factory=lambda: next(_order))  # arrival order, kept on preemption

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """No prefix-cache or tier hits: prompt_logprobs and MEAN/CLS pooling need a row for
        every prompt token (vLLM skips the cache for them too)."""
        return self.params.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.needs_whole_prompt()
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len
