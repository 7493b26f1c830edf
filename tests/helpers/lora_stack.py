"""LoRA adapters for the whole-stack tests: PEFT adapters for SmolLM2 with random non-zero A and B,
and peft's greedy text with them."""

from __future__ import annotations

import copy
from pathlib import Path

from tests.helpers import hf_reference

NEW_TOKENS = 24


PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def make_adapter(hf_model, path: Path, seed: int, r: int, targets: list[str]):
    """A PEFT adapter with random non-zero A and B saved to ``path``, and its peft model."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    conf = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(hf_model), conf)
    with torch.no_grad():  # a change that keeps the text readable
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.4)
    model.save_pretrained(str(path))
    return model.eval()


def greedy_text(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt)["input_ids"]
    (new,) = hf_reference.generate(
        model, ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=1
    )
    return tokenizer.decode(new, skip_special_tokens=True)
