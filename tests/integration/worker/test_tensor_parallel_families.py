"""Tensor parallelism beyond Llama: Qwen2 (q/k/v biases, a sliding-window layer), Gemma 3
(sandwich norms, per-head q/k norms, interleaved windows and two RoPEs), Mixtral (every expert
cut by its intermediate features) and Qwen2-MoE (experts, a shared expert, a dense layer) cut
over 2 gloo ranks
in spawned processes, each rank running the real scheduler core's plans: every rank's greedy
tokens equal transformers' (tests/helpers/families.py), batched under chunked prefill."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kvflow.services.worker import machine
from kvflow.services.worker.model_loader import load_weights
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.tensor_parallel import TPGroup, shard_config, shard_weights, tp_layout
from kvflow.shared.config import Settings
from kvflow.shared.messages import SamplingParams
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from tests.helpers.engine import new_core, run
from tests.helpers.families import NEW, PROMPTS, hf_greedy, save_model

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _rank(rank: int, world: int, init: str, path: str, results: dict) -> None:
    machine.configure(Settings.from_env())  # a spawned process, set up as a worker's rank is
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        src = ModelSource("hf", Path(path), "tiny")
        cfg = load_config(src)
        layout = tp_layout(cfg, rank, world)
        shard = shard_weights(load_weights(src, cfg), cfg, layout)
        runner = ModelRunner.from_weights(shard_config(cfg, layout), shard, 4, 64, worker_id="w")
        runner.model.tp = TPGroup(layout)
        jobs = [(p, None) for p in PROMPTS]
        results[rank] = run(new_core(max_num_batched_tokens=8), runner, jobs, GREEDY)[0]
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "mixtral", "qwen2_moe"])
def test_two_ranks_equal_transformers(family: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        hf = save_model(family, Path(tmp) / "model")
        want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
        results = manager.dict()
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_rank, args=(2, init, str(Path(tmp) / "model"), results), nprocs=2, join=True)
        assert results[0] == want
        assert results[1] == want


def test_olmo2_is_refused_with_a_reason() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        save_model("olmo2", Path(tmp))
        cfg = load_config(ModelSource("hf", Path(tmp), "tiny"))
    with pytest.raises(ValueError, match="q/k norms run over all heads"):
        tp_layout(cfg, 0, 2)
