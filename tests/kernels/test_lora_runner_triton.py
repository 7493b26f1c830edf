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
from tests.helpers.engine import new_core  # noqa: E402
from tests.helpers.lora import GREEDY, PROMPTS, argmax_tokens, make_adapter, run  # noqa: E402
from tests.helpers.tiny_llama import make_runner  # noqa: E402


def device_runner(hf, **kw) -> ModelRunner:
    dev = "cuda" if HAS_CUDA else "cpu"
    return make_runner(hf, worker_id="w", backend="triton", device=dev, lora=LoRASpec(2, 16), **kw)


def test_device_path_mixed_batch_equals_peft_and_cpu_path(
    tiny_llama,
    tmp_path,
) -> None:
    p1 = make_adapter(tiny_llama, tmp_path / "a1", seed=1)
    p2 = make_adapter(tiny_llama, tmp_path / "a2", seed=2, r=4, targets=["q_proj", "v_proj"])
    a1, a2 = LoRARef("a1", 1, str(tmp_path / "a1")), LoRARef("a2", 2, str(tmp_path / "a2"))
    jobs = [(PROMPTS[0], a1), (PROMPTS[1], None), (PROMPTS[2], a2), (PROMPTS[1], a1)]
    cpu, _ = run(new_core(), make_runner(tiny_llama, worker_id="w", lora=LoRASpec(2, 16)), jobs)
    dev = device_runner(tiny_llama, cuda_graphs=True, max_num_seqs=4)
    got, plans = run(new_core(max_num_batched_tokens=16), dev, jobs)
    assert got == cpu
    for (prompt, ref), tokens in zip(jobs, got, strict=True):
        model = tiny_llama if ref is None else (p1 if ref is a1 else p2)
        assert tokens == argmax_tokens(model, prompt, GREEDY.max_tokens)
    assert dev.loras is not None and dev.loras.stacks is not None
    assert sorted(dev.loras.slot_of) == ["a1", "a2"]
    assert sorted(dev.loras.slot_of.values()) == [0, 1]  # one slot each
    assert max(len(p.seqs) for p in plans) == 4  # all four in one step
