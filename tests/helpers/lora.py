"""LoRA adapters for the tiny Llama: PEFT adapters with random non-zero A and B, peft's argmax
tokens, and requests with adapters through the scheduler core and a runner."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from kvflow.shared.messages import SamplingParams
from tests.helpers.engine import run as engine_run

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


PROMPTS = [
    [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33],
    [120, 6, 6, 90, 12],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102, 103],
]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(core, runner, jobs, params=GREEDY):
    return engine_run(core, runner, jobs, params)


def make_adapter(
    hf: LlamaForCausalLM,
    path: Path,
    seed: int,
    r: int = 8,
    targets: list[str] | None = None,
    rslora: bool = False,
) -> torch.nn.Module:
    """A PEFT LoRA adapter with random non-zero A and B (PEFT's ``init_lora_weights=False``),
    saved to ``path``; returns the peft model (a copy of ``hf`` with the adapter)."""
    torch.manual_seed(seed)
    conf = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=targets or ALL,
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(hf), conf)
    with torch.no_grad():  # B as large as the tiny model's own weights (x10): outputs change
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return model.eval()


def argmax_tokens(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(input_ids=torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]
