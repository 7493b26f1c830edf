"""vLLM's ``cache_salt`` through the whole stack: the scheduler's prefix-cache hit counters
(/stats, in blocks) show that a long prompt sent again with the same salt reuses its blocks,
while another salt, or no salt after a salted request, computes them again; greedy output is the
same either way."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.stack import openai_client, text_prompt_ids, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def test_same_salt_hits_the_prefix_cache_other_salts_do_not(stack, tokenizer) -> None:
    prompt = text_prompt_ids(tokenizer, 264, seed=4242)  # a prompt no other test sends
    client = openai_client(stack)

    def hits(salt: str | None) -> tuple[int, str]:
        """Send the prompt: (prefix-cache block hits it scored, its greedy text)."""
        before = wait_all_blocks_free(stack)["prefix_cache_hits"]
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
        )
        return wait_all_blocks_free(stack)["prefix_cache_hits"] - before, r.choices[0].text

    full = (len(prompt) - 1) // 16  # 16-token blocks, one token always computed
    first, text = hits("tenant-a")
    assert first == 0
    assert hits("tenant-a") == (full, text)  # the same salt: every full block hits
    assert hits("tenant-b") == (0, text)  # another salt: nothing shared
    assert hits(None) == (0, text)  # no salt after salted requests: nothing shared
    assert hits(None) == (full, text)  # unsalted requests share among themselves


def test_empty_salt_is_a_400_naming_it(stack) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for route, body in (("/v1/chat/completions", chat), ("/v1/responses", {"input": "hi"})):
        body = {"model": MODEL, "max_output_tokens": 2} | body
        r = httpx.post(f"{stack}{route}", json=body | {"cache_salt": ""}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"
        r = httpx.post(f"{stack}{route}", json=body | {"cache_salt": "s"}, timeout=60)
        assert r.status_code == 200, r.text
