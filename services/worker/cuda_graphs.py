"""Decode steps as CUDA graphs: one graph per batch size of a ladder, replayed with the step's
inputs copied into static buffers.

A decode step of a small model is mostly kernel-launch overhead when run eagerly (hundreds of
launches of microsecond kernels); a CUDA graph replays them all with one launch. Graphs have
fixed shapes and addresses, so:

- batch sizes come from a ladder (``capture_sizes``: 1, 2, 4, 8, then multiples of 16 up to
  max_num_seqs); a step of n sequences runs in the graph of the next size up
  (``padded_size``), its extra rows padded: token 0, position 0, slot -1 (the KV write skips
  it), seq_len 0 (decode attention gives zeros) and a zero block table row;
- every input lives in one static int32 device buffer (``DecodeBuffers``) whose views the graphs
  captured; a step writes its inputs into a host staging buffer of the same layout (pinned) and
  copies them over with one ``non_blocking`` copy before the replay;
- block tables are ``W = ceil(max_model_len / block_size)`` wide, and the flash-decoding split
  count of each size is fixed at capture from that capacity (the grid must not change);
- logits land in one static fp32 buffer [max size, vocab], valid until the next replay;
- sizes are captured largest first into one shared memory pool (the smaller graphs reuse the
  larger one's intermediate memory; only one graph runs at a time), each right after an eager
  warm-up run of the same size (Triton compiles its kernels there, never during a capture).

Prefill and mixed steps, and decode steps larger than the largest size, run eagerly.

With ``capture=False`` (the CPU, the tests) ``DecodeGraphs`` runs the very same padded
static-buffer step eagerly instead of replaying a graph: everything but the capture itself is
exercised on machines without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvflow.services.worker.step_inputs import DeviceBatch, fill_tables

log = logging.getLogger("kvflow.worker")

ForwardFn = Callable[[DeviceBatch], torch.Tensor]
"""``DeviceBatch -> fp32 logits [B, vocab]`` (``DecoderModel.forward_device`` on the runner's
caches and backend)."""

SplitsFn = Callable[[int], int | None]
"""batch size -> flash-decoding split count for that graph (None: the kernel's default)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``
    itself, none above it."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be at least 1")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n`` rows; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """The static inputs of the decode graphs: one int32 device buffer laid out as
    ``[ids | positions | slots | seq_lens]`` (``max_batch`` each) then the block tables
    ``[max_batch, max_blocks]``, and a host staging buffer of the same layout."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks, self.device = max_batch, max_blocks, device
        self._head = 4 * max_batch
        n = self._head + max_batch * max_blocks
        pinned = device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int32, pin_memory=pinned)
        self.device_buf = torch.zeros(n, dtype=torch.int32, device=device)
        self._np = self.host.numpy()
        # the copy of the previous step must be done before the staging buffer is rewritten
        self._copied: torch.cuda.Event | None = None
        no_tables = np.zeros((0, 0), dtype=np.int32)
        self.fill([], [], [], [], no_tables, max_batch)  # every row padding until a step runs
        self.upload(max_batch)

    def _seg(self, buf: torch.Tensor | np.ndarray, i: int, n: int) -> torch.Tensor | np.ndarray:
        b = self.max_batch
        return buf[i * b : i * b + n]

    def _tables(self, buf: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        return buf[self._head :].reshape(self.max_batch, self.max_blocks)

    def fill(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: np.ndarray,
        padded: int,
    ) -> None:
        """Write n sequences' decode inputs into rows ``[0, n)`` of the staging buffer and
        padding into rows ``[n, padded)``: token 0, position 0, slot -1, seq_len 0, block
        table row 0."""
        n = len(token_ids)
        if not n <= padded <= self.max_batch:
            raise ValueError(f"{n} rows padded to {padded} (at most {self.max_batch})")
        if block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"a block table is wider than {self.max_blocks} blocks")
        if self._copied is not None:
            self._copied.synchronize()
        a = self._np
        for i, (vals, pad) in enumerate(
            ((token_ids, 0), (positions, 0), (slots, -1), (seq_lens, 0))
        ):
            seg = self._seg(a, i, padded)
            seg[:n] = vals
            seg[n:] = pad
        fill_tables(self._tables(a)[:padded], block_tables)

    def upload(self, padded: int) -> None:
        """Copy the staged inputs of ``padded`` rows to the device buffer (one copy)."""
        n = self._head + padded * self.max_blocks
        if self.device.type == "cpu":
            self.device_buf[:n].copy_(self.host[:n])
            return
        self.device_buf[:n].copy_(self.host[:n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def batch(self, size: int, num_splits: int | None) -> DeviceBatch:
        """Views of the device buffer for a decode step of ``size`` rows."""
        buf = self.device_buf
        return DeviceBatch(
            input_ids=self._seg(buf, 0, size),
            positions=self._seg(buf, 1, size),
            slot_mapping=self._seg(buf, 2, size),
            seq_lens=self._seg(buf, 3, size),
            block_tables=self._tables(buf)[:size],
            query_start_loc=None,
            max_query_len=1,
            sample_rows=None,
            num_splits=num_splits,
        )


class DecodeGraphs:
    """Decode steps of up to ``max(sizes)`` sequences through static buffers: replayed CUDA
    graphs (``capture=True``, CUDA only) or the same padded step run eagerly."""

    def __init__(
        self,
        forward: ForwardFn,
        sizes: Sequence[int],
        max_blocks: int,
        vocab_size: int,
        device: torch.device,
        splits: SplitsFn,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.device = device
        self.capture_enabled = capture
        self._forward = forward
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device)
        self.logits = torch.zeros(self.sizes[-1], vocab_size, dtype=torch.float32, device=device)
        self.num_splits = {b: splits(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through this path (graph replays or their eager stand-in)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, n: int, widest_table: int) -> bool:
        return 0 < n <= self.max_batch and widest_table <= self.max_blocks

    def _step(self, size: int) -> None:
        out = self._forward(self.buffers.batch(size, self.num_splits[size]))
        self.logits[:size].copy_(out)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first, into one pool; returns the seconds it took.
        Call once, before any step runs (warm-up runs write nothing: every row is padding)."""
        if not self.capture_enabled:
            return 0.0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):
            with torch.cuda.stream(stream):
                self._step(size)  # warm-up: compiles and autotunes outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step(size)
            self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            self.sizes,
            seconds,
        )
        return seconds

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """One decode step of n sequences padded to the next captured size; returns logits
        [n, vocab] (a view of the static buffer: use it before the next step)."""
        n = len(token_ids)
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"{n} sequences: more than the largest graph ({self.max_batch})")
        self.buffers.fill(token_ids, positions, slots, seq_lens, block_tables, size)
        self.buffers.upload(size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        elif self.capture_enabled:
            raise RuntimeError(f"no CUDA graph captured for batch size {size}")
        else:
            self._step(size)
        self.replays += 1
        return self.logits[:n]
