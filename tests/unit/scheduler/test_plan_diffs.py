"""Plans as differences: a request's block table goes whole in the plan that announces it to a
worker, and after that only the blocks added since (``block_table_from``); the worker's
``BlockTables`` rebuilds the whole table (a list, and a row of one array the step's tables are
gathered from), and refuses a difference it cannot apply or a block id outside the cache."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.block_tables import BlockTables, PlanStateError
from kvflow.shared.messages import (
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.speculative import SpeculativeConfig


def test_a_table_goes_whole_once_then_as_the_blocks_added() -> None:
    core = SchedulerCore(SchedulerLimits())
    ws = core.add_worker("w", 64, 4)
    core.add_request(TokenizedRequest("r", "", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8)))
    tables = BlockTables(64)
    sent, whole = [], []
    for step in range(6):
        plan, _ = core.schedule(ws)
        [s] = plan.seqs
        sent.append((s.block_table_from, list(s.block_table)))
        tables.apply(plan)
        whole.append(list(s.block_table))
        assert s.block_table == core.requests["r"].blocks  # rebuilt on the worker
        core.on_result(StepResult("w", plan.step_id, ["r"], [7 + step], [0]))
    assert sent[0] == (-1, whole[0]) and len(whole[0]) == 2  # 6 tokens: two blocks, whole
    for i in range(1, len(sent)):  # then what the worker does not hold yet, from where it ends
        assert sent[i] == (len(whole[i - 1]), whole[i][len(whole[i - 1]) :])
    assert len(whole[-1]) == 3 and sum(len(t) for _, t in sent[1:]) == 1  # one block added


def test_rejected_drafts_cut_the_table_and_the_next_plan_restarts_there() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1)
    core = SchedulerCore(SchedulerLimits(), speculative=spec)
    ws = core.add_worker("w", 64, 4)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    core.add_request(TokenizedRequest("r", "", prompt, SamplingParams(max_tokens=16)))
    tables = BlockTables(64)
    plan, _ = core.schedule(ws)
    tables.apply(plan)
    core.on_result(StepResult("w", plan.step_id, ["r"], [2], [0]))
    plan, _ = core.schedule(ws)  # drafts into a fourth block
    [s] = plan.seqs
    assert s.num_draft >= 5
    tables.apply(plan)
    held = len(s.block_table)
    core.on_result(StepResult("w", plan.step_id, ["r"], [9], [0]))  # every draft rejected
    seq = core.requests["r"]
    assert len(seq.blocks) < held  # the blocks of the rejected drafts went back
    # the worker's table is cut there too: blocks added later never hide behind the old length
    assert seq.sent_blocks == len(seq.blocks)
    for step in range(8):  # on past the cut, into a new fourth block
        plan, _ = core.schedule(ws)
        [s] = plan.seqs
        assert 0 <= s.block_table_from <= len(seq.blocks)
        tables.apply(plan)
        assert s.block_table == seq.blocks
        core.on_result(StepResult("w", plan.step_id, ["r"], [20 + step], [0]))
    assert len(seq.blocks) >= held


def test_a_difference_the_worker_cannot_apply_fails_instead_of_guessing() -> None:
    tables = BlockTables(16)
    with pytest.raises(PlanStateError, match="holds no table"):
        tables.apply(StepPlan(1, [ScheduledSeq("r", [5], 8, [3], block_table_from=2)]))
    tables.apply(StepPlan(2, [ScheduledSeq("r", [1, 2, 3, 4, 5], 0, [4, 7])]))
    with pytest.raises(PlanStateError, match="holds 2 blocks"):  # a plan in between was missed
        tables.apply(StepPlan(3, [ScheduledSeq("r", [5], 12, [9], block_table_from=3)]))
    tables.apply(StepPlan(4, [], finished_request_ids=["r"]))
    assert tables.tables == {}


def test_the_difference_field_is_appended_on_the_wire() -> None:
    old = msgspec.msgpack.encode(["r", [1], 0, [4, 7], True, 0, 0])  # before the field
    seq = msgspec.msgpack.decode(old, type=ScheduledSeq)
    assert seq.block_table_from == -1 and seq.block_table == [4, 7]  # a whole table
    new = msgspec.msgpack.decode(
        msgspec.msgpack.encode(ScheduledSeq("r", [1], 0, [], block_table_from=3))
    )
    assert new[-1] == 3 and len(new) == 8


def _padded(tables: BlockTables, rids: list[str], width: int) -> list[list[int]]:
    return [(tables.tables[r] + [0] * width)[:width] for r in rids]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 12), st.integers(0, 9)), max_size=60))
def test_the_table_rows_are_the_lists_zero_padded_through_any_plans(ops) -> None:
    """Whole tables, differences, tables cut short (rejected drafts), finished requests whose
    rows are taken again, rows and widths past the first allocation: ``rows`` always gives
    each held list, zero-padded, as ``host_batch`` and the device path read it."""
    tables = BlockTables(num_blocks=1000)
    for step, (r, start, n) in enumerate(ops):
        rid = f"r{r}"
        held = tables.tables.get(rid)
        new = [(step * 7 + i) % 1000 for i in range(n * 9)]  # up to 81 blocks: past 64
        if start < 0 or held is None:
            tables.apply(StepPlan(step, [ScheduledSeq(rid, [1], 0, new)]))
            assert tables.tables[rid] == new
        elif start > len(held):
            tables.apply(StepPlan(step, [], finished_request_ids=[rid]))
            assert rid not in tables.tables
        else:
            want = held[:start] + new
            seq = ScheduledSeq(rid, [1], 0, new, block_table_from=start)
            tables.apply(StepPlan(step, [seq]))
            assert seq.block_table == want and seq.block_table_from == -1
            assert seq.block_table is tables.tables[rid]  # the table held, not a copy
        rids = sorted(tables.tables)
        for width in {0, 3, max((len(t) for t in tables.tables.values()), default=0) + 2}:
            got = tables.rows(rids + rids[:1], width)
            assert got.dtype == np.int32 and got.shape == (len(rids) + len(rids[:1]), width)
            assert got.tolist() == _padded(tables, rids + rids[:1], width)
    tables.clear()
    assert tables.tables == {} and not tables._array.any()  # every row zeroed for reuse


def test_block_ids_outside_the_cache_are_refused_as_they_arrive() -> None:
    tables = BlockTables(num_blocks=8)
    with pytest.raises(ValueError, match="bad block table"):
        tables.apply(StepPlan(1, [ScheduledSeq("r", [1] * 5, 0, [2, 8])]))
    tables.apply(StepPlan(2, [ScheduledSeq("r", [1] * 5, 0, [2, 7])]))
    with pytest.raises(ValueError, match="bad block table"):
        tables.apply(StepPlan(3, [ScheduledSeq("r", [1], 8, [-1], block_table_from=2)]))
    assert tables.tables["r"] == [2, 7]  # nothing of the refused difference was applied
    used = tables.used([ScheduledSeq("r", [1], 4, [])], [5], block_size=4)
    assert used.tolist() == [[2, 7]]
