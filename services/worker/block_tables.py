"""Plans as differences, on the worker: each request's block table, kept from plan to plan.

A plan sends a request's block table whole only when the worker is new to it (the plan that
carries its NewRequest); after that only the blocks added since the plan before
(``ScheduledSeq.block_table_from``: the index they start at; a table cut short by rejected
drafts restarts there). Each runner (the model runner, the simulated one; every rank of a
tensor-parallel group, which all see the same plans) keeps a ``BlockTables`` beside its request
state: ``apply`` first thing in a step puts each sequence's whole table back into the plan (the
table held here, not a copy), so the rest of the step reads whole tables.

The tables are also kept as rows of one int32 array, written only where a plan changes them, so
that a step's tables for the model are one gather (``rows``) rather than a conversion of every
block id of every sequence from Python lists: with long contexts that conversion was most of a
decode step's host work (256 sequences of 4,096 tokens: ~3 ms a step for the tables alone).

Block ids are checked once, as they arrive (in ``[0, num_blocks)``): a table held here holds
only ids checked before. A plan whose difference does not fit what this worker holds (it never
had the request, or holds fewer blocks than the difference starts at: a plan it missed) fails
the step instead of guessing; the scheduler then re-queues the step's sequences, and their next
plan sends them whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.shared.messages import ScheduledSeq, StepPlan


class PlanStateError(RuntimeError):
    """A plan's difference does not apply to what this worker holds."""


class BlockTables:
    """request id -> its whole block table, as the plans run here built it; each table also a
    row of one int32 array (zero past the table's end)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tables: dict[str, list[int]] = {}
        self._row: dict[str, int] = {}  # request id -> its row of ``_array``
        self._free: list[int] = []  # rows of finished requests, zeroed
        self._array = np.zeros((64, 64), dtype=np.int32)
        self._rows_used = 0

    def apply(self, plan: StepPlan) -> None:
        """Forget the plan's finished requests, then give each of its sequences its whole
        table (in place). Raises PlanStateError for a difference with nothing to apply to and
        ValueError for a block id outside the cache."""
        for rid in plan.finished_request_ids:
            self._forget(rid)
        for s in plan.seqs:
            if s.block_table:
                self._check(s)
            held = self.tables.get(s.request_id)
            if s.block_table_from < 0:
                if held is None:
                    held = self.tables[s.request_id] = []
                self._write(s.request_id, held, 0, s.block_table)
                s.block_table = held
                continue
            if held is None or len(held) < s.block_table_from:
                have = "no table" if held is None else f"{len(held)} blocks"
                raise PlanStateError(
                    f"step {plan.step_id}: request {s.request_id}'s block table continues at "
                    f"block {s.block_table_from}, and this worker holds {have} for it"
                )
            if s.block_table or s.block_table_from < len(held):  # (most decode steps: neither)
                self._write(s.request_id, held, s.block_table_from, s.block_table)
            s.block_table = held
            s.block_table_from = -1

    def rows(self, request_ids: Sequence[str], width: int) -> np.ndarray:
        """The tables of ``request_ids`` (repeats allowed), ``width`` blocks each: [B, width]
        int32, a copy. Past a table's end: 0; a narrower width cuts tables short."""
        if width > self._array.shape[1]:
            self._widen(width)
        return self._array[[self._row[r] for r in request_ids], :width]

    def used(
        self, seqs: Sequence[ScheduledSeq], ends: Sequence[int], block_size: int
    ) -> np.ndarray:
        """The device path's tables of a step: each of ``seqs``' rows as wide as the blocks
        that its tokens up to ``ends`` fill reach (the widest of them: entries past a
        sequence's own are never read)."""
        width = max((-(-e // block_size) for e in ends), default=0)
        return self.rows([s.request_id for s in seqs], width)

    def clear(self) -> None:
        """Forget every table (a new scheduler term sends them whole)."""
        for rid in list(self.tables):
            self._forget(rid)

    def _check(self, s: ScheduledSeq) -> None:
        new = s.block_table
        if min(new) < 0 or max(new) >= self.num_blocks:
            raise ValueError(
                f"{s.request_id}: bad block table: block ids {new} outside [0, {self.num_blocks})"
            )

    def _write(self, rid: str, held: list[int], start: int, new: list[int]) -> None:
        """``held[start:] = new``, in the list and in the request's row."""
        row = self._row.get(rid)
        if row is None:
            row = self._row[rid] = self._take_row()
        old_len, end = len(held), start + len(new)
        if end > self._array.shape[1]:
            self._widen(end)
        a = self._array[row]
        a[start:end] = new
        if old_len > end:
            a[end:old_len] = 0
        del held[start:]
        held += new

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._rows_used == self._array.shape[0]:
            grown = np.zeros((2 * self._array.shape[0], self._array.shape[1]), dtype=np.int32)
            grown[: self._rows_used] = self._array
            self._array = grown
        self._rows_used += 1
        return self._rows_used - 1

    def _widen(self, width: int) -> None:
        w = max(width, 2 * self._array.shape[1])
        grown = np.zeros((self._array.shape[0], w), dtype=np.int32)
        grown[:, : self._array.shape[1]] = self._array
        self._array = grown

    def _forget(self, rid: str) -> None:
        held = self.tables.pop(rid, None)
        row = self._row.pop(rid, None)
        if row is not None:
            self._array[row, : len(held or ())] = 0
            self._free.append(row)
