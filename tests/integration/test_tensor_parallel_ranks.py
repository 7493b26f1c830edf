"""Tensor-parallel ranks as real gloo process groups on this CPU (2 and 3 spawned processes
over a file rendezvous) against the whole model in one process: the same greedy tokens, logits
within a stated tolerance (a sum over ranks is ordered differently from one GEMM's), and
followers that run only what rank 0 broadcasts (services/worker/tp_group.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from services.worker.runner import ModelRunner
from services.worker.tensor_parallel import TPGroup, shard_config, shard_weights, tp_layout
from services.worker.tp_group import TPLeader, follow
from shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan
from tests.unit.tp_support import BLOCK, BLOCKS, CFG, PROMPTS, TOKENS, weights


def drive(
    runner: ModelRunner, leader: TPLeader | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill the prompts in one step, then decode TOKENS - 1 steps; every request's tokens and
    every step's logits rows."""
    logits: list[torch.Tensor] = []
    sample = runner._sample

    def spy(rows, sampled):  # noqa: ANN001, ANN202
        logits.append(rows.detach().clone())
        return sample(rows, sampled)

    runner._sample = spy
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    tables = [list(range(r * 8, r * 8 + 8)) for r in range(len(PROMPTS))]
    new = [NewRequest(f"r{i}", greedy, len(p)) for i, p in enumerate(PROMPTS)]
    seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(PROMPTS)]
    out: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(TOKENS):
        res = (leader or runner).execute(StepPlan(step + 1, seqs, new if step == 0 else []))
        assert res.error is None, res.error
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            out[int(rid[1:])].append(tok)
        seqs = [
            ScheduledSeq(f"r{i}", [out[i][-1]], len(p) + len(out[i]) - 1, tables[i])
            for i, p in enumerate(PROMPTS)
        ]
    return out, logits


def _rank(rank: int, world: int, init: str, results: dict, lead: bool) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        layout = tp_layout(CFG, rank, world)
        runner = ModelRunner.from_weights(
            shard_config(CFG, layout), shard_weights(weights(), CFG, layout), BLOCK, BLOCKS
        )
        runner.model.tp = TPGroup(layout)
        if not lead:
            results[rank] = drive(runner)
        elif rank == 0:  # the worker's side: its plans reach the followers by broadcast
            leader = TPLeader([])
            leader.runner = runner
            leader.reset()  # followers reset too (nothing to forget yet)
            results[rank] = drive(runner, leader)
            leader.close()  # the followers stop; the group is taken down
        else:
            results[rank] = ([], [torch.tensor(float(follow(runner)))])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_group(
    world: int, lead: bool = False
) -> dict[int, tuple[list[list[int]], list[torch.Tensor]]]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_rank, args=(world, init, results, lead), nprocs=world, join=True)
        return dict(results)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_forward_equals_the_whole_model(world: int) -> None:
    """Every rank gets the same tokens as the whole model in one process, and the logits agree
    within 1e-4 (relative to their scale): the partial sums of O, down and the embedding are
    added across ranks in another order than one process adds them."""
    want_tokens, want_logits = drive(ModelRunner.from_weights(CFG, weights(), BLOCK, BLOCKS))
    results = run_group(world)
    assert sorted(results) == list(range(world))
    for rank, (tokens, logits) in results.items():
        assert tokens == want_tokens, rank
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max(), rtol=1e-4)


def test_followers_run_the_plans_rank_0_broadcasts() -> None:
    """Rank 0 alone is driven (as the worker on the bus would be); rank 1 only follows its
    broadcasts, and both end when rank 0 stops: rank 0's tokens are the whole model's."""
    want_tokens, _ = drive(ModelRunner.from_weights(CFG, weights(), BLOCK, BLOCKS))
    results = run_group(2, lead=True)
    assert results[0][0] == want_tokens
    assert float(results[1][1][0]) == TOKENS  # every step ran on the follower too
