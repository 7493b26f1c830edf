"""Tensor parallelism, the model half (services/worker/tensor_parallel.py): which heads, KV heads,
intermediate features and vocabulary rows each rank holds, and the sharded forward pass over
real gloo process groups (2 and 3 processes on this CPU) against the whole model in one process:
the same greedy tokens, logits within a stated tolerance (a sum over ranks is ordered
differently from one GEMM's)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from services.worker.model_setup import KvSpec
from services.worker.runner import ModelRunner
from services.worker.tensor_parallel import TPGroup, shard_config, shard_weights, tp_layout
from services.worker.tp_group import TPLeader, follow, group_blocks
from shared.config import Settings
from shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan
from shared.model_loader import ModelConfig
from shared.parallel import check_parallel_settings

# SmolLM2's ratios, small: 9 heads over 3 KV heads (GQA 3), head_dim 8
CFG = ModelConfig(
    vocab_size=120,
    hidden_size=72,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=8,
    intermediate_size=96,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(119,),
)
BLOCK, BLOCKS = 4, 32
PROMPTS = [[5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33], [11, 22, 33], [7]]
TOKENS = 12


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, h = CFG.hidden_size, CFG.head_dim
    q, kv, i = CFG.num_heads * h, CFG.num_kv_heads * h, CFG.intermediate_size

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    w = {"model.embed_tokens.weight": mat(CFG.vocab_size, d), "model.norm.weight": 1 + mat(d) / 3}
    for n in range(CFG.num_layers):
        p = f"model.layers.{n}."
        w |= {
            p + "input_layernorm.weight": 1 + mat(d) / 3,
            p + "post_attention_layernorm.weight": 1 + mat(d) / 3,
            p + "self_attn.q_proj.weight": mat(q, d),
            p + "self_attn.k_proj.weight": mat(kv, d),
            p + "self_attn.v_proj.weight": mat(kv, d),
            p + "self_attn.o_proj.weight": mat(d, q),
            p + "mlp.gate_proj.weight": mat(i, d),
            p + "mlp.up_proj.weight": mat(i, d),
            p + "mlp.down_proj.weight": mat(d, i),
        }
    return w


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


def test_layouts_cover_the_model_once() -> None:
    for world in (1, 2, 3, 4, 9):
        layouts = [tp_layout(CFG, r, world) for r in range(world)]
        assert [h for lay in layouts for h in lay.heads] == list(range(CFG.num_heads))
        assert [j for lay in layouts for j in lay.inter] == list(range(CFG.intermediate_size))
        assert [v for lay in layouts for v in lay.vocab] == list(range(CFG.vocab_size))
        for lay in layouts:  # uniform GQA inside the rank: local head i -> KV head i // per
            per = len(lay.heads) // len(lay.kv_heads)
            assert per * len(lay.kv_heads) == len(lay.heads)
            group = CFG.num_heads // CFG.num_kv_heads
            for i, h in enumerate(lay.heads):
                assert lay.kv_heads[i // per] == h // group
    # SmolLM2's 9 heads: over 3 ranks one KV head each; over 2 (5 + 4 heads) replicated copies
    assert [tp_layout(CFG, r, 3).kv_heads for r in range(3)] == [(0,), (1,), (2,)]
    assert tp_layout(CFG, 0, 2).kv_heads == (0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="more than the model's 9 heads"):
        tp_layout(CFG, 0, 10)
    sharded = shard_weights(weights(), CFG, tp_layout(CFG, 1, 2))
    assert sharded["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 72)
    assert sharded["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 8, 72)
    assert sharded["model.layers.0.mlp.down_proj.weight"].shape == (72, 48)
    assert sharded["lm_head.weight"].shape == (60, 72)  # tied: the embedding's rows


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


def test_the_shard_config_is_a_model_config() -> None:
    cfg = shard_config(CFG, tp_layout(CFG, 0, 2))
    assert dataclasses.astuple(cfg)[:6] == (120, 72, 2, 5, 5, 8)


def test_parallel_settings_that_cannot_be_served_are_refused() -> None:
    check_parallel_settings(Settings.of(tensor_parallel_size=2))  # a plain group: fine
    with pytest.raises(ValueError, match="--pipeline-parallel-size is not supported yet"):
        check_parallel_settings(Settings.of(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="at least 1"):
        check_parallel_settings(Settings.of(tensor_parallel_size=0))
    for refused, flag in [
        ({"quantization": "int8"}, "--quantization"),
        ({"enable_lora": True}, "--enable-lora"),
        ({"role": "decode"}, "--role"),
        ({"kv_host_memory": 1.0}, "--kv-host-memory"),
        ({"kv_redis_tier": True}, "--kv-redis-tier"),
        ({"worker_backend": "sim"}, "--worker-backend sim"),
    ]:
        with pytest.raises(ValueError, match=flag):
            check_parallel_settings(Settings.of(tensor_parallel_size=2, **refused))
    for off in ({"quantization": "int8"}, {"role": "decode"}):  # all of it works with one rank
        check_parallel_settings(Settings.of(**off))


def test_every_rank_gets_the_blocks_of_the_rank_with_the_most_kv_heads() -> None:
    kv = KvSpec(block_size=4, num_blocks=None, kv_cache_gib=1 / 1024)  # 1 MiB
    # over 2 ranks rank 0 holds 5 KV head copies (of 3): 2 layers x 4 tokens x 5 x 8 x 2 x 4 B
    assert group_blocks(CFG, kv, torch.float32, 2) == 2**20 // (2 * 2 * 4 * 5 * 8 * 4)
    assert group_blocks(CFG, kv, torch.float32, 3) == 2**20 // (2 * 2 * 4 * 1 * 8 * 4)
    fixed = KvSpec(block_size=4, num_blocks=77)
    assert group_blocks(CFG, fixed, torch.float32, 2) == 77
