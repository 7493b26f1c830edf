"""The real SmolLM2 GGUF through a ModelRunner in this process: greedy generation of several
prompts in the same steps, with the logits each token was picked from."""

from __future__ import annotations

import torch

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import SamplingParams
from tests.helpers.runner_steps import generate_in_steps

NEW_TOKENS = 32
BLOCK = 16
EOS = 2


def generate(
    runner: ModelRunner, prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy generation of all ``prompts`` in the same steps until each stops (prompt ``i``'s
    blocks from 16 i, descending); returns the tokens and the logits each token was picked
    from."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    first = [16 * i for i in range(len(prompts))]
    return generate_in_steps(runner, prompts, first, params, BLOCK, NEW_TOKENS, (EOS,))
