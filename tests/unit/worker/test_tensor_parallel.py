"""Tensor parallelism, the pure parts: which heads, KV heads, intermediate features and
vocabulary rows each rank holds (services/worker/tensor_parallel.py), the KV blocks of a group,
and the parallel settings refused (shared/parallel.py). The ranks themselves run in
tests/integration/worker/test_tensor_parallel_ranks.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow.services.worker.model_setup import KvSpec
from kvflow.services.worker.tensor_parallel import shard_config, shard_weights, tp_layout
from kvflow.services.worker.tp_group import group_blocks
from kvflow.shared.config import Settings
from kvflow.shared.parallel import check_parallel_settings
from tests.helpers.tensor_parallel import CFG, weights


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


def test_the_shard_config_is_a_model_config() -> None:
    cfg = shard_config(CFG, tp_layout(CFG, 0, 2))
    assert dataclasses.astuple(cfg)[:6] == (120, 72, 2, 5, 5, 8)


def test_parallel_settings_that_cannot_be_served_are_refused() -> None:
    check_parallel_settings(Settings.of(tensor_parallel_size=2))  # a plain group: fine
    cuts = [{"enable_lora": True}, {"quantization": "int8"}, {"quantization": "fp8"}]
    cuts += [{"role": "decode"}, {"kv_host_memory": 1.0}, {"kv_redis_tier": True}]  # every rank's
    for cut in cuts:
        check_parallel_settings(Settings.of(tensor_parallel_size=2, **cut))  # cut per rank
    with pytest.raises(ValueError, match="--pipeline-parallel-size is not supported yet"):
        check_parallel_settings(Settings.of(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="at least 1"):
        check_parallel_settings(Settings.of(tensor_parallel_size=0))
    for refused, flag in [
        ({"quantization": "gguf"}, "--quantization gguf"),
        ({"quantization": "gptq"}, "--quantization gptq"),
        ({"worker_backend": "sim"}, "--worker-backend sim"),
    ]:
        with pytest.raises(ValueError, match=flag):
            check_parallel_settings(Settings.of(tensor_parallel_size=2, **refused))
    for off in (
        {"quantization": "gguf"},
        {"worker_backend": "sim"},
    ):  # all of it works with one rank
        check_parallel_settings(Settings.of(**off))


def test_every_rank_gets_the_blocks_of_the_rank_with_the_most_kv_heads() -> None:
    kv = KvSpec(block_size=4, num_blocks=None, kv_cache_gib=1 / 1024)  # 1 MiB
    # over 2 ranks rank 0 holds 5 KV head copies (of 3): 2 layers x 4 tokens x 5 x 8 x 2 x 4 B
    assert group_blocks(CFG, kv, torch.float32, 2) == 2**20 // (2 * 2 * 4 * 5 * 8 * 4)
    assert group_blocks(CFG, kv, torch.float32, 3) == 2**20 // (2 * 2 * 4 * 1 * 8 * 4)
    fixed = KvSpec(block_size=4, num_blocks=77)
    assert group_blocks(CFG, fixed, torch.float32, 2) == 77


def test_a_group_block_is_every_rank_s_bytes_in_rank_order() -> None:
    from kvflow.services.worker.kv_blocks import KvBlockIO

    def caches(heads: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((4, 2, heads, 3), fill), torch.full((4, 2, heads, 3), -fill))] * 2

    ranks = [caches(2, 1.0), caches(1, 2.0)]
    io = KvBlockIO(ranks[0], ranks)
    assert io.layout() == "float32:2x2x2+1x3" and io.num_kv_heads == 3
    assert io.layer_bytes == 2 * 2 * (2 + 1) * 3 * 4
    one = [KvBlockIO(c) for c in ranks]
    assert io.read(1, 0, 1) == one[0].read(1, 0, 1) + one[1].read(1, 0, 1)
    data = io.read(1)
    io.write(3, data)  # another block: every rank's part lands in its own cache
    assert all(r.read(3) == r.read(1) for r in one)
    with pytest.raises(ValueError, match="expected"):
        io.write(0, data[:-4])
