"""`kvflow serve --quantization gguf|int8` through the openai SDK.

gguf (the GGUF's Q4_1/Q8_0 blocks read in place by the CPU kernels) computes on the same
weights as the fp32 default: greedy text equal to Hugging Face transformers' on the same file,
streamed and not, alone and in a shared batch. int8 rounds the weights (a scale per 32), so its
text may part from fp32's wherever fp32 had a near tie (on "def fibonacci(n):" it does at the
first token): it must equal itself alone, batched and streamed; its accuracy is measured by
`kvflow bench quality` (perplexity, top-1 agreement) and the integration test's chat prompts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import hf_reference
from tests.helpers.stack import openai_client, running_stack

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three uses of copper:\n1."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_texts(hf_model, tokenizer) -> dict[str, list[int]]:
    return {
        p: hf_reference.generate(
            hf_model, tokenizer(p)["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False
        )[0]
        for p in PROMPTS
    }


@pytest.mark.parametrize("scheme", ["gguf", "int8"])
def test_greedy_text_through_the_openai_sdk(scheme: str, hf_texts, tokenizer) -> None:
    args = ("--quantization", scheme, "--max-model-len", "1024")
    with running_stack(f"quant-{scheme}", *args) as base:
        client = openai_client(base)

        def complete(p: str) -> str:
            r = client.completions.create(
                model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0
            )
            return r.choices[0].text

        alone = {p: complete(p) for p in PROMPTS}
        with ThreadPoolExecutor(len(PROMPTS)) as ex:  # in one batch
            assert dict(zip(PROMPTS, ex.map(complete, PROMPTS), strict=True)) == alone
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == alone[PROMPTS[0]]
    if scheme == "gguf":
        for p in PROMPTS:
            assert alone[p] == tokenizer.decode(hf_texts[p], skip_special_tokens=True), p
    else:
        assert all(alone[p].strip() for p in PROMPTS)
