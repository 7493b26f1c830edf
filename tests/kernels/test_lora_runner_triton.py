"""LoRA on the worker's device path (ModelRunner with the Triton backend: adapters in slot
stacks, every row through ``lora_shrink``/``lora_expand``) against transformers + peft and the
CPU path, through the real scheduler core: a mixed batch of the base model and two adapters,
with ``max_loras`` 2 and a CUDA-graph ladder (steps with an adapter run eagerly). Without a GPU the kernels run in Triton's
interpreter."""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py does

from kvflow.services.worker.lora import LoRASpec  # noqa: E402
from kvflow.services.worker.runner import ModelRunner  # noqa: E402
from kvflow.shared.messages import LoRARef  # noqa: E402
from tests.models.test_lora_engine import (  # noqa: E402
    GREEDY,
    PROMPTS,
    argmax_tokens,
    make_adapter,
    new_core,
    run,
)
from tests.models.test_runner_tiny import hf_model, make_runner  # noqa: E402, F401


def device_runner(hf, **kw) -> ModelRunner:
    dev = "cuda" if HAS_CUDA else "cpu"
    return make_runner(hf, worker_id="w", backend="triton", device=dev, lora=LoRASpec(2, 16), **kw)


def test_device_path_mixed_batch_equals_peft_and_cpu_path(
    hf_model,  # noqa: F811
    tmp_path,
) -> None:
    p1 = make_adapter(hf_model, tmp_path / "a1", seed=1)
    p2 = make_adapter(hf_model, tmp_path / "a2", seed=2, r=4, targets=["q_proj", "v_proj"])
    a1, a2 = LoRARef("a1", 1, str(tmp_path / "a1")), LoRARef("a2", 2, str(tmp_path / "a2"))
    jobs = [(PROMPTS[0], a1), (PROMPTS[1], None), (PROMPTS[2], a2), (PROMPTS[1], a1)]
    cpu, _ = run(new_core(), make_runner(hf_model, worker_id="w", lora=LoRASpec(2, 16)), jobs)
    dev = device_runner(hf_model, cuda_graphs=True, max_num_seqs=4)
    got, plans = run(new_core(max_num_batched_tokens=16), dev, jobs)
    assert got == cpu
    for (prompt, ref), tokens in zip(jobs, got, strict=True):
        model = hf_model if ref is None else (p1 if ref is a1 else p2)
        assert tokens == argmax_tokens(model, prompt, GREEDY.max_tokens)
    assert dev.loras is not None and dev.loras.stacks is not None
    assert sorted(dev.loras.slot_of) == ["a1", "a2"]
    assert sorted(dev.loras.slot_of.values()) == [0, 1]  # one slot each
    assert max(len(p.seqs) for p in plans) == 4  # all four in one step
