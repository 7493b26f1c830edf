"""A step's metadata for the device path (the Triton backend): built on the host from the
StepPlan, packed into one int32 buffer (pinned on CUDA) and copied to the device once per step
with ``non_blocking``, then read through views. The host buffer is the runner's ``Staging``,
kept from step to step (pinning memory is a driver call that costs more than the step's copy);
it grows when a step needs more and is written again only once its last copy has finished.

``DeviceBatch`` is what a model's ``forward_device`` takes (services/worker/model_interface.py); the CUDA-graph decode path
(services/worker/cuda_graphs.py) fills the same fields from static buffers instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeviceBatch:
    """Inputs of one forward pass on the device: T token rows of B sequences.

    ``query_start_loc`` None means a decode step (one token per sequence, T == B; attention
    through ``decode_attention``); otherwise a varlen step through ``extend_attention``.
    ``sample_rows`` None means logits for every row (the CUDA-graph path picks rows after)."""

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32, -1: do not write (padded rows)
    block_tables: torch.Tensor  # [B, W] int32 (entries past a sequence's blocks: never read)
    seq_lens: torch.Tensor  # [B] int32, 0 for padded rows
    query_start_loc: torch.Tensor | None  # [B + 1] int32, or None for a decode step
    max_query_len: int
    sample_rows: torch.Tensor | None  # [S] int32 rows whose logits are wanted; None: all
    num_splits: int | None = None  # decode: flash-decoding splits (None: from the shapes)
    # [T] each token's sequence's prompt length, for length-dependent RoPE (longrope; None
    # otherwise: such models run without decode graphs)
    prompt_lens: torch.Tensor | None = None
    # [T] each token's segment of a text pair (models with token-type embeddings); None: all 0
    token_types: torch.Tensor | None = None


@dataclass
class HostStep:
    """A step as the runner lays it out (rows in the runner's order)."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]
    block_tables: np.ndarray  # [B, W] int32: each sequence's used blocks (BlockTables.rows)
    seq_lens: Sequence[int]
    query_lens: Sequence[int]
    sample_rows: Sequence[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def fill_tables(out: np.ndarray, tables: np.ndarray) -> None:
    """Write ``tables`` [B, W] into ``out`` [>= B, >= W]; everything else in ``out`` (the rest
    of each row, rows past B) becomes 0."""
    out[:] = 0
    b, w = tables.shape
    out[:b, :w] = tables


class Staging:
    """The host buffer a runner packs its steps into, one per runner and reused (pinned on
    CUDA). ``take`` waits for the copy out of the previous step's buffer before handing it
    out again; ``send`` copies a filled buffer to the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of ``_host``
        self.allocations = 0  # host buffers made so far (grows only when a step needs more)

    def take(self, n: int) -> torch.Tensor:
        """``n`` int32 of the buffer, free to write."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if n > self._host.numel():
            size = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self.allocations += 1
        return self._host[:n]

    def send(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (from ``take``) on the device; on the CPU a copy, since the buffer is
        written again by the next step."""
        if self.device.type == "cpu":
            return host.clone()
        buf = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return buf


def pack(step: HostStep, staging: Staging) -> DeviceBatch:
    """Every int of ``step`` in ``staging``'s host buffer, one copy to its device, and views
    of it. A decode step has no ``query_start_loc``."""
    t, b, s = len(step.token_ids), len(step.seq_lens), len(step.sample_rows)
    w = step.block_tables.shape[1]
    decode = step.is_decode
    sizes = [t, t, t, b, 0 if decode else b + 1, s, b * w]
    offs = np.cumsum([0, *sizes]).tolist()
    host = staging.take(offs[-1])
    a = host.numpy()
    a[offs[0] : offs[1]] = step.token_ids
    a[offs[1] : offs[2]] = step.positions
    a[offs[2] : offs[3]] = step.slots
    a[offs[3] : offs[4]] = step.seq_lens
    if not decode:
        a[offs[4]] = 0
        np.cumsum(step.query_lens, out=a[offs[4] + 1 : offs[5]])
    a[offs[5] : offs[6]] = step.sample_rows
    fill_tables(a[offs[6] :].reshape(b, w), step.block_tables)
    buf = staging.send(host)

    def seg(i: int) -> torch.Tensor:
        return buf[offs[i] : offs[i + 1]]

    return DeviceBatch(
        input_ids=seg(0),
        positions=seg(1),
        slot_mapping=seg(2),
        block_tables=seg(6).view(b, w),
        seq_lens=seg(3),
        query_start_loc=None if decode else seg(4),
        max_query_len=max(step.query_lens, default=0),
        sample_rows=seg(5),
    )
