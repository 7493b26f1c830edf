"""Tensor-parallel ranks as real gloo process groups on this CPU (2 and 3 spawned processes
over a file rendezvous) against the whole model in one process: the same greedy tokens, logits
within a stated tolerance (a sum over ranks is ordered differently from one GEMM's), and
followers that run only what rank 0 broadcasts (services/worker/tp_group.py)."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

from kvflow.services.worker import machine, tp_shm
from kvflow.services.worker.lora import LoRASpec
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.tensor_parallel import (
    LoRAShard,
    TPGroup,
    shard_config,
    shard_weights,
    tp_layout,
)
from kvflow.services.worker.tp_group import GROUP_FAILED_EXIT, TPLeader, follow
from kvflow.services.worker.tp_shm import ShmComm
from kvflow.shared.config import Settings
from kvflow.shared.messages import LoRARef, NewRequest, SamplingParams, ScheduledSeq, StepPlan
from tests.helpers.tensor_parallel import (
    BLOCK,
    BLOCKS,
    CFG,
    PROMPTS,
    TOKENS,
    weights,
    write_adapter,
)

# bytes of a shared-memory slot: a decode step's [3, 72] fp32 rows and [3, 60] logits fit, the
# first step's prefill rows ([15, 72]) do not, so both ways run within one test
SLOT = 3 * 72 * 4


def drive(
    runner: ModelRunner, leader: TPLeader | None = None, adapter: str = ""
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
    # with an adapter: requests 0 and 2 use it, request 1 the base model (one mixed batch)
    lora = [LoRARef("a", 1, adapter) if adapter and i != 1 else None for i in range(len(PROMPTS))]
    new = [NewRequest(f"r{i}", greedy, len(p), lora=lora[i]) for i, p in enumerate(PROMPTS)]
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


def _rank(
    rank: int, world: int, init: str, results: dict, lead: bool, shm: str, adapter: str
) -> None:  # noqa: ANN001, E501
    machine.configure(Settings.from_env())  # a spawned process, set up as a worker's rank is
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        layout = tp_layout(CFG, rank, world)
        lora = LoRASpec(2, 8, shard=LoRAShard(CFG, layout)) if adapter else None
        runner = ModelRunner.from_weights(
            shard_config(CFG, layout),
            shard_weights(weights(), CFG, layout),
            BLOCK,
            BLOCKS,
            lora=lora,
        )
        comm = ShmComm(shm, rank, world, SLOT) if shm else None
        runner.model.tp = TPGroup(layout, comm)
        if not lead:
            results[rank] = drive(runner, adapter=adapter)
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
    world: int, lead: bool = False, shm: bool = False, adapter: str = ""
) -> dict[int, tuple[list[list[int]], list[torch.Tensor]]]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        path = os.path.join(tmp, "collectives") if shm else ""
        if shm:
            tp_shm.create(path, world, SLOT)
        args = (world, init, results, lead, path, adapter)
        mp.spawn(_rank, args=args, nprocs=world, join=True)
        return dict(results)


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shared-memory"])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_forward_equals_the_whole_model(world: int, shm: bool) -> None:
    """Every rank gets the same tokens as the whole model in one process, and the logits agree
    within 1e-4 (relative to their scale): the partial sums of O, down and the embedding are
    added across ranks in another order than one process adds them. The collectives run over
    gloo, or over shared memory (services/worker/tp_shm.py) with gloo for what does not fit a
    slot (SLOT is smaller than the prefill's partial sums)."""
    want_tokens, want_logits = drive(ModelRunner.from_weights(CFG, weights(), BLOCK, BLOCKS))
    results = run_group(world, shm=shm)
    assert sorted(results) == list(range(world))
    for rank, (tokens, logits) in results.items():
        assert tokens == want_tokens, rank
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max(), rtol=1e-4)


@pytest.mark.parametrize("world", [2, 3])
def test_lora_adapters_over_ranks_equal_the_whole_model(world: int, tmp_path) -> None:  # noqa: ANN001
    """Each rank cuts every adapter as its weights are cut (services/worker/tensor_parallel.py
    LoRAShard): a batch of two adapter requests and one base request gives the whole model's
    tokens with the same adapter, which differ from the base model's."""
    adapter = str(tmp_path / "adapter")
    write_adapter(tmp_path / "adapter")
    whole = ModelRunner.from_weights(CFG, weights(), BLOCK, BLOCKS, lora=LoRASpec(2, 8))
    want_tokens, want_logits = drive(whole, adapter=adapter)
    base_tokens, _ = drive(ModelRunner.from_weights(CFG, weights(), BLOCK, BLOCKS))
    assert want_tokens[1] == base_tokens[1] and want_tokens[0] != base_tokens[0]
    results = run_group(world, shm=True, adapter=adapter)
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


def _shm_rank(rank: int, world: int, path: str, results: dict) -> None:  # noqa: ANN001
    comm = ShmComm(path, rank, world, 1 << 16)
    out = []
    for n in range(5):  # more collectives than buffer sets: the sets are reused safely
        g = torch.Generator().manual_seed(100 * n + rank)
        x = torch.randn(4, 33, generator=g)
        out.append(comm.all_reduce(x).clone())
    parts = comm.all_gather(torch.full((2, 3), float(rank)))
    out.append(torch.cat([p.clone() for p in parts]))
    results[rank] = out


def test_shared_memory_collectives_give_every_rank_the_same_bits() -> None:
    world = 3
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        path = os.path.join(tmp, "collectives")
        tp_shm.create(path, world, 1 << 16)
        mp.spawn(_shm_rank, args=(world, path, results), nprocs=world, join=True)
        results = dict(results)
    for n in range(5):
        xs = [
            torch.randn(4, 33, generator=torch.Generator().manual_seed(100 * n + r))
            for r in range(world)
        ]
        want = xs[0] + xs[1] + xs[2]  # in rank order, as every rank sums
        for r in range(world):
            assert torch.equal(results[r][n], want), (n, r)
    gathered = torch.cat([torch.full((2, 3), float(r)) for r in range(world)])
    assert all(torch.equal(results[r][5], gathered) for r in range(world))


def _hung_follower(rank: int, init: str, path: str) -> None:
    """Rank 1 takes the plan and then never joins its collectives; rank 0 leads with a 1 s
    collective timeout."""
    machine.configure(Settings.from_env())  # a spawned process, set up as a worker's rank is
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layout = tp_layout(CFG, rank, 2)
    runner = ModelRunner.from_weights(
        shard_config(CFG, layout), shard_weights(weights(), CFG, layout), BLOCK, BLOCKS
    )
    runner.model.tp = TPGroup(layout, ShmComm(path, rank, 2, 1 << 20, timeout_s=1.0))
    if rank == 1:
        size = torch.zeros(1, dtype=torch.long)
        torch.distributed.broadcast(size, 0)
        torch.distributed.broadcast(torch.empty(int(size), dtype=torch.uint8), 0)
        time.sleep(60)  # hung: rank 0 must not wait for it
        return
    leader = TPLeader([])
    leader.runner = runner
    drive(runner, leader)  # the first step's collective times out: the group goes down


def test_a_collective_that_times_out_takes_rank_0_down() -> None:
    """A rank that hangs: rank 0's collective raises after its timeout, the step is not
    answered and rank 0 exits with the group-failed code (the scheduler then migrates)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "collectives")
        tp_shm.create(path, 2, 1 << 20)
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        with pytest.raises(mp.ProcessExitedException) as exited:
            mp.spawn(_hung_follower, args=(init, path), nprocs=2, join=True)
    assert exited.value.error_index == 0 and exited.value.exit_code == GROUP_FAILED_EXIT
