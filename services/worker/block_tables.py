"""Plans as differences, on the worker: each request's block table, kept from plan to plan.

A plan sends a request's block table whole only when the worker is new to it (the plan that
carries its NewRequest); after that only the blocks added since the plan before
(``ScheduledSeq.block_table_from``: the index they start at; a table cut short by rejected
drafts restarts there). Each runner (the model runner, the simulated one; every rank of a
tensor-parallel group, which all see the same plans) keeps a ``BlockTables`` beside its request
state: ``apply`` first thing in a step puts each sequence's whole table back into the plan, so
the rest of the step reads whole tables.

A plan whose difference does not fit what this worker holds (it never had the request, or holds
fewer blocks than the difference starts at: a plan it missed) fails the step instead of
guessing; the scheduler then re-queues the step's sequences, and their next plan sends them whole.
"""

from __future__ import annotations

from shared.messages import StepPlan


class PlanStateError(RuntimeError):
    """A plan's difference does not apply to what this worker holds."""


class BlockTables:
    """request id -> its whole block table, as the plans run here built it."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        """Forget the plan's finished requests, then give each of its sequences its whole
        table (in place). Raises PlanStateError for a difference with nothing to apply to."""
        for rid in plan.finished_request_ids:
            self.tables.pop(rid, None)
        for s in plan.seqs:
            if s.block_table_from < 0:
                self.tables[s.request_id] = list(s.block_table)
                continue
            held = self.tables.get(s.request_id)
            if held is None or len(held) < s.block_table_from:
                have = "no table" if held is None else f"{len(held)} blocks"
                raise PlanStateError(
                    f"step {plan.step_id}: request {s.request_id}'s block table continues at "
                    f"block {s.block_table_from}, and this worker holds {have} for it"
                )
            del held[s.block_table_from :]
            held += s.block_table
            s.block_table = list(held)
            s.block_table_from = -1

    def clear(self) -> None:
        """Forget every table (a new scheduler term sends them whole)."""
        self.tables.clear()
