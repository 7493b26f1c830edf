"""What a sequence's share of a step looks like on the wire (shared/messages/steps.py): its
``ScheduledSeq`` and, the first time a worker runs it, its ``NewRequest``. Pure functions;
the worker state (worker_state.py) sends them and notes what the worker now holds."""

from __future__ import annotations

from kvflow.services.scheduler.decision import Run
from kvflow.services.scheduler.sequence import Sequence
from kvflow.shared.messages import PLACEHOLDER, NewRequest, ScheduledSeq
from kvflow.shared.sampling import needs_token_history


def scheduled_seq(run: Run, table_from: int) -> ScheduledSeq:
    """A sequence's share of the plan: its next known tokens, a placeholder for each token
    a plan in flight samples, then its drafts; its block table from entry ``table_from`` on
    (-1: whole, for a worker new to it; else only the blocks added since the last plan)."""
    s = run.seq
    start, end = run.start, run.start + run.num_new
    have = len(s.token_ids)
    if end <= have:
        token_ids = s.token_ids[start:end]
    elif start >= have:  # a decode step on top of a plan in flight: its token is not known
        token_ids = [PLACEHOLDER] * run.num_new
    else:
        token_ids = s.token_ids[start:] + [PLACEHOLDER] * (end - have)
    num_draft = num_worker = 0
    if run.drafts:
        tokens, num_worker = run.drafts
        token_ids += tokens
        num_draft = len(tokens)
    table = s.blocks[table_from:] if table_from > 0 else list(s.blocks)
    return ScheduledSeq(
        request_id=s.request_id,
        token_ids=token_ids,
        start_pos=start,
        block_table=table,
        sample=run.sample,
        num_draft=num_draft,
        num_propose=num_worker,
        block_table_from=table_from,
    )


def announce(seq: Sequence) -> NewRequest:
    """What a worker needs to know of a sequence the first time it runs there."""
    return NewRequest(
        request_id=seq.request_id,
        params=seq.params,
        prompt_len=seq.prompt_len,
        num_output_tokens=seq.num_output_tokens,
        eos_token_ids=seq.eos_token_ids,
        token_history=list(seq.token_ids) if needs_token_history(seq.params) else [],
        pooling=seq.pooling,
        lora=seq.lora,
    )
