"""Greedy generation of several prompts in the same steps, straight through a ModelRunner
(hand-made plans: no scheduler), with the logits each token was picked from."""

from __future__ import annotations

import torch

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import FinishReason, NewRequest, SamplingParams, ScheduledSeq, StepPlan


def generate_in_steps(
    runner: ModelRunner,
    prompts: list[list[int]],
    first: list[int],
    params: SamplingParams,
    block: int,
    new_tokens: int,
    stop_ids: tuple[int, ...],
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """All ``prompts`` in the same steps until each stops: prompt ``i``'s blocks (room for
    ``new_tokens``) start at ``first[i]``, in descending order; a sequence that ends must end
    with STOP on one of ``stop_ids`` or with LENGTH. Returns the tokens and the logits each
    token was picked from."""
    step = runner.total_computed_tokens  # any increasing id will do
    rids = [f"s{step}-{i}" for i in range(len(prompts))]
    tables, live = {}, {}
    outs: dict[str, list[int]] = {r: [] for r in rids}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in rids}
    new = []
    for rid, p, b in zip(rids, prompts, first, strict=True):
        n_blocks = -(-(len(p) + new_tokens) // block)
        tables[rid] = list(range(b, b + n_blocks))[::-1]
        live[rid] = list(p)
        new.append(NewRequest(rid, params, len(p)))
    sample = runner._sample

    def spy(step_logits: torch.Tensor, sampled: list[ScheduledSeq]) -> torch.Tensor:
        for row, s in enumerate(sampled):
            logits[s.request_id].append(step_logits[row].clone())
        return sample(step_logits, sampled)

    runner._sample = spy
    pos = dict.fromkeys(live, 0)
    try:
        while live:
            seqs = [ScheduledSeq(r, t[pos[r] :], pos[r], tables[r]) for r, t in live.items()]
            res = runner.execute(StepPlan(step, seqs, new))
            assert res.error is None, res.error
            step, new = step + 1, []
            for r, tok, fr in zip(res.request_ids, res.token_ids, res.finish_reasons, strict=True):
                pos[r] = len(live[r])
                live[r].append(tok)
                outs[r].append(tok)
                if fr != FinishReason.NONE:
                    assert fr == (FinishReason.STOP if tok in stop_ids else FinishReason.LENGTH)
                    del live[r]
    finally:
        del runner._sample
    return [outs[r] for r in rids], [logits[r] for r in rids]
