"""The device path (Triton kernels; Triton's interpreter on a CPU, fp32) serves the families'
features too: Gemma 2 (sliding windows and attention soft-caps in both attention kernels,
GELU-tanh, sandwich norms), Qwen3 (per-head q/k norms, a window on one layer) and Phi-3
(longrope: each token's rows picked from its sequence's prompt length on the device, which also
turns the decode graphs off) and Qwen2-MoE (experts grouped by token on the device, a shared
expert, a dense layer; eager steps). Greedy output through the real scheduler core equals
transformers', batched under chunked prefill."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py does

from kvflow.services.worker.runner import ModelRunner  # noqa: E402
from kvflow.shared.messages import SamplingParams  # noqa: E402
from kvflow.shared.model_source import ModelSource  # noqa: E402
from tests.helpers.engine import new_core, run  # noqa: E402
from tests.helpers.families import hf_greedy, save_model  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33], [120, 6, 6, 90, 12, 7, 7, 31]]
NEW = 10  # positions past the windows (6) and phi3's original length (16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "phi3", "qwen2_moe"])
def test_device_path_equals_transformers(family: str, tmp_path) -> None:
    hf = save_model(family, tmp_path)
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runner = ModelRunner.create(
        ModelSource("hf", tmp_path, family),
        block_size=4,
        num_blocks=32,
        worker_id="w",
        device=DEVICE,
        backend="triton",
        cuda_graphs=True,  # the padded static-buffer decode path (run eagerly on a CPU)
        max_num_seqs=4,
    )
    # longrope, experts (their token counts are data): no decode graphs
    assert (runner.graphs is None) == (family in ("phi3", "qwen2_moe"))
    if family == "qwen2_moe":  # the experts run as grouped launches (kernels/triton_moe.py)
        assert runner.model.layers[0].moe.gate_up_stacked is not None
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got, _ = run(new_core(max_num_batched_tokens=8), runner, [(p, None) for p in PROMPTS], greedy)
    assert got == want
