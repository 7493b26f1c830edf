"""A step's inputs as the runner lays them out: single-token sequences (decode) first, then one
GEMM segment per longer chunk; the flat token rows with their positions and KV slots, the rows
to sample, the prompt-logprob rows, the rows embedding requests pool and their text pairs' token
types (``lay_out``), and the CPU path's ForwardBatch over them
(``host_batch``; the device path packs the same rows in services/worker/step_inputs.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.kernels import reference as K
from kvflow.kernels.batch_invariance import GemmRows
from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.model_interface import ForwardBatch
from kvflow.services.worker.prompt_logprobs import PromptRows
from kvflow.shared.messages import ScheduledSeq


@dataclass
class StepRows:
    """The flat token rows of one step (in ``order``: the runner's order of the plan's seqs)."""

    seqs: list[ScheduledSeq]
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # last row of each sampled chunk
    segments: list[tuple[int, int]] = field(default_factory=list)  # chunks of 2+ rows
    prompt_rows: PromptRows = field(default_factory=PromptRows)  # rows for prompt logprobs
    # embedding requests (services/worker/pooling.py): rows whose final hidden states are
    # pooled, and per request of them (in order) how many of those rows are its
    pool_rows: list[int] = field(default_factory=list)
    pool_pieces: list[tuple[str, int]] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)  # per row: its sequence's prompt length
    # per row: its segment of a text pair (a pooling request's ``pair_start`` on: 1); empty
    # when no request of the step has a pair
    token_types: list[int] = field(default_factory=list)

    @property
    def logits_rows(self) -> list[int]:
        """Rows whose logits the model computes: sampled rows, then prompt-logprob rows."""
        return self.sample_rows + self.prompt_rows.rows


def lay_out(
    plan_seqs: list[ScheduledSeq],
    requests: Mapping[str, Any],
    block_size: int,
    max_positions: int,
) -> StepRows:
    """Check each chunk against its block table and the model, and lay its tokens out as rows;
    ``requests`` maps request ids to the runner's RequestState. The tables are the ones
    ``BlockTables.apply`` gave the plan (their block ids checked there)."""
    bs = block_size
    singles = [s for s in plan_seqs if len(s.token_ids) <= 1]  # (an empty one is refused)
    step = StepRows(singles + [s for s in plan_seqs if len(s.token_ids) > 1])
    ids, pos, slots, prompt_lens = step.ids, step.pos, step.slots, step.prompt_lens
    for s in step.seqs:
        n = len(s.token_ids)
        if n == 0:
            raise ValueError(f"{s.request_id}: empty chunk")
        start = s.start_pos
        end = start + n
        table = s.block_table
        if len(table) * bs < end:  # (its block ids were checked as they arrived)
            raise ValueError(
                f"{s.request_id}: bad block table for {end} tokens: {len(table)} blocks"
            )
        if end > max_positions:
            raise ValueError(f"{s.request_id}: {end} tokens exceed the model's positions")
        st = requests.get(s.request_id)
        if s.sample and st is None:
            raise KeyError(f"{s.request_id}: unknown request (no NewRequest)")
        start_row = len(ids)
        if n == 1:  # a decode row (most rows of most steps)
            ids.append(s.token_ids[0])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            prompt_lens.append(getattr(st, "prompt_len", None) or end)
        else:
            ids += s.token_ids
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            prompt_lens += [getattr(st, "prompt_len", None) or end] * n
            step.segments.append((start_row, len(ids)))
        pool = getattr(st, "pool", None)
        if pool is not None:  # an embedding request: pooled rows, nothing sampled
            rows = pool.rows_of(s)
            step.pool_rows += [start_row + r for r in rows]
            step.pool_pieces.append((s.request_id, len(rows)))
            pair = pool.pooling.pair_start
            if pair:
                types = step.token_types
                types += [0] * (start_row - len(types))  # the rows before: one text each
                types += [int(p >= pair) for p in range(start, end)]
        elif s.sample:
            step.sample_rows.append(len(ids) - 1)
        if st is not None:
            if st.guide is not None:  # tokens generated before a preemption
                st.guide.replay(s, st.prompt_len)
            step.prompt_rows.add(s, st, start_row)
    if step.token_types:
        step.token_types += [0] * (len(ids) - len(step.token_types))
    return step


def host_batch(
    step: StepRows,
    block_tables: BlockTables,
    block_size: int,
    decode_fn: Callable[..., Any] | None,
    gemm_rows: GemmRows | None,
) -> ForwardBatch:
    """The CPU path's ForwardBatch: attention plan, batch-invariant row layout, logits rows;
    ``block_tables`` holds the step's tables."""
    seqs = step.seqs
    width = max(len(s.block_table) for s in seqs)
    tables = torch.from_numpy(block_tables.rows([s.request_id for s in seqs], width)).long()
    qlens = torch.tensor([len(s.token_ids) for s in seqs])
    seq_lens = torch.tensor([s.start_pos + len(s.token_ids) for s in seqs])
    num_single = len(seqs) - len(step.segments)
    rows = None
    if gemm_rows:
        rows = K.RowLayout(num_single, tuple(step.segments), gemm_rows.tile, gemm_rows.pad)
    return ForwardBatch(
        slot_mapping=torch.tensor(step.slots),
        attn=K.plan_attention(tables, seq_lens, qlens, block_size, decode_fn=decode_fn),
        rows=rows,
        sample_rows=torch.tensor(step.logits_rows, dtype=torch.long),
        hidden_rows=torch.tensor(step.pool_rows, dtype=torch.long) if step.pool_rows else None,
        token_prompt_lens=torch.tensor(step.prompt_lens),
        query_lens=qlens,
        token_types=torch.tensor(step.token_types) if step.token_types else None,
    )
