"""Families other than Llama through the whole stack as a user runs it: a tiny random Qwen3
(q/k norms, a sliding-window layer), Gemma 2 (sandwich norms, soft-caps, GELU) and GPT-NeoX
(no kvflow family file: `--model-impl auto` serves it through transformers' modules) saved as
Hugging Face directories with SmolLM2's tokenizer, served by `kvflow serve --model DIR`: the
openai SDK's greedy completions equal transformers' greedy text on the same directory, alone
and in a shared batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.families import hf_generate, make_model
from tests.helpers.stack import openai_client, running_stack

pytestmark = pytest.mark.e2e
NEW = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three uses of copper:\n1.",
]


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gpt_neox"])
def family_dir(request, tmp_path_factory, tokenizer):
    """A tiny model of the family with SmolLM2's vocabulary and tokenizer, saved to disk."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_model(request.param, vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return request.param, path, hf


def test_completions_equal_transformers(family_dir, tokenizer) -> None:
    name, path, hf = family_dir
    want = {}
    for p in PROMPTS:
        ids = tokenizer(p)["input_ids"]
        with torch.no_grad():
            want[p] = tokenizer.decode(hf_generate(hf, ids, NEW), skip_special_tokens=True)
    args = ["--model", str(path), "--max-model-len", "64", "--max-num-batched-tokens", "16"]
    with running_stack(f"family-{name}", *args) as base:
        client = openai_client(base)

        def complete(p: str) -> str:
            r = client.completions.create(
                model=path.name,
                prompt=p,
                max_tokens=NEW,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        assert {p: complete(p) for p in PROMPTS[:1]} == {PROMPTS[0]: want[PROMPTS[0]]}
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = dict(zip(PROMPTS, ex.map(complete, PROMPTS), strict=True))
        assert got == want
