"""`kvflow serve --quantization gguf` (the GGUF's Q4_1/Q8_0 blocks read in place by the CPU
kernels) through the openai SDK: greedy text equal to Hugging Face transformers' on the same
file, streamed and not, alone and in a shared batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.conftest import openai_client, running_stack

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three uses of copper:\n1."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_client():
    with running_stack("gguf", "--quantization", "gguf", "--max-model-len", "1024") as base:
        yield openai_client(base)


def test_greedy_text_equals_transformers(gguf_client, hf_model, tokenizer) -> None:
    want = {}
    for p in PROMPTS:
        ids = tokenizer(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        want[p] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    def complete(p: str) -> str:
        r = gguf_client.completions.create(
            model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0
        )
        return r.choices[0].text

    assert {p: complete(p) for p in PROMPTS} == want  # alone
    with ThreadPoolExecutor(len(PROMPTS)) as ex:  # in one batch
        assert dict(zip(PROMPTS, ex.map(complete, PROMPTS), strict=True)) == want
    stream = gguf_client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[PROMPTS[0]]
