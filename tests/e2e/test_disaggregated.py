"""Disaggregated serving through the whole stack: `kvflow serve --prefill-workers 1
--decode-workers 2`. Greedy output equals the aggregated stack's (a prompt whose KV is ~45 MB,
many times one NATS message, included); shared prefixes land on the decode worker that holds
them while unrelated requests spread; embeddings stay on the prefill worker; a worker that joins gets work, one that leaves cleanly
gets no more and exits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.faults import stack_credentials
from tests.helpers.stack import ROOT, openai_client, running_stack, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def disagg_stack():
    args = ["--prefill-workers", "1", "--decode-workers", "2", "--max-model-len", "2048"]
    args += ["--kv-cache-memory", "0.3"]
    with running_stack("disagg", *args) as base:
        yield base


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=5).json()


def workers(base: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in stats(base)["workers"]}


def complete(base: str, prompt, max_tokens: int) -> str:
    r = openai_client(base).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].text


def long_prompt(tokenizer, n: int, seed: int) -> list[int]:
    words = ["harbor", "signal", "copper", "meadow", "lantern", "orchard", "valley", "ember"]
    text = " ".join(f"{words[(i * 5 + seed) % 8]} {i}," for i in range(n))
    return tokenizer(text)["input_ids"][:n]


def test_greedy_output_equals_aggregated(stack, disagg_stack, tokenizer) -> None:
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        long_prompt(tokenizer, 1000, seed=1),  # 63 blocks of 737 KB: ~45 MB of K/V
    ]
    before = stats(disagg_stack)
    with ThreadPoolExecutor(3) as pool:  # concurrently: several transfers in flight
        got = list(pool.map(lambda p: complete(disagg_stack, p, 24), prompts))
    want = [complete(stack, p, 24) for p in prompts]
    assert got == want
    after = stats(disagg_stack)
    assert after["kv_transfers"] - before["kv_transfers"] == len(prompts)
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
    assert after["kv_transfer_bytes"] - before["kv_transfer_bytes"] > 40 * 2**20
    wait_all_blocks_free(disagg_stack)


def test_penalties_and_bad_words_see_the_prompt_on_the_decode_worker(stack, disagg_stack) -> None:
    """The decode worker computes none of the prompt (its K/V comes from the prefill worker),
    yet repetition_penalty and bad_words depend on every token: same output as aggregated."""
    body = {
        "model": MODEL,
        "prompt": "The old fisherman told the same story every night. The story was about",
        "max_tokens": 20,
        "temperature": 0,
        "repetition_penalty": 1.3,
        "bad_words": ["fish", "sea"],
        "ignore_eos": True,
    }

    def text(base: str) -> str:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(disagg_stack) == text(stack)


def test_seeded_sampling_continues_on_the_decode_worker(stack, disagg_stack) -> None:
    """The prefill worker samples a seeded request's first token, a decode worker the rest: the
    text is the aggregated stack's (each token's draw depends on the seed and its position
    only, not on which worker, or how many draws it made before)."""
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "extra_body": {"ignore_eos": True}}

    def text(base: str) -> str:
        r = openai_client(base).completions.create(
            model=MODEL, prompt="Write a short poem about the sea.", max_tokens=16, **kw
        )
        return r.choices[0].text

    assert text(disagg_stack) == text(stack)


def test_shared_prefixes_follow_their_blocks_and_others_spread(disagg_stack, tokenizer) -> None:
    prefix = long_prompt(tokenizer, 320, seed=2)  # 20 full blocks
    complete(disagg_stack, prefix + tokenizer(" Summary:")["input_ids"], 2)
    before = workers(disagg_stack)
    for tail in (" First,", " Then", " Finally the", " In short"):
        complete(disagg_stack, prefix + tokenizer(tail)["input_ids"], 2)
    after = workers(disagg_stack)
    decodes = {w: after[w]["num_decodes"] - before[w]["num_decodes"] for w in after}
    home = max(decodes, key=decodes.get)
    assert decodes[home] == 4 and after[home]["role"] == "decode"
    hits = after[home]["prefix_cache_hits"] - before[home]["prefix_cache_hits"]
    assert hits >= 4 * 20  # every later request found the prefix's 20 blocks there
    # unrelated prompts submitted together: both decode workers get some
    before = workers(disagg_stack)
    unrelated = [long_prompt(tokenizer, 60, seed=10 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: complete(disagg_stack, p, 16), unrelated))
    after = workers(disagg_stack)
    spread = [
        after[w]["num_decodes"] - before[w]["num_decodes"]
        for w in after
        if after[w]["role"] == "decode"
    ]
    assert sum(spread) == 6 and min(spread) >= 1, spread
    wait_all_blocks_free(disagg_stack)


def test_embeddings_run_on_the_prefill_worker_and_never_move(
    stack, disagg_stack, tokenizer
) -> None:
    """An embedding request is a prefill that ends with its vector: the prefill worker
    computes it and it is never handed to a decode worker (no transfer, no decode); the vector
    equals the aggregated stack's."""
    inputs = [long_prompt(tokenizer, 200, seed=20), tokenizer("The capital is Paris.")["input_ids"]]
    before, transfers = workers(disagg_stack), stats(disagg_stack)["kv_transfers"]
    got = openai_client(disagg_stack).embeddings.create(
        model=MODEL, input=inputs, encoding_format="float"
    )
    want = openai_client(stack).embeddings.create(
        model=MODEL, input=inputs, encoding_format="float"
    )
    for g, w in zip(got.data, want.data, strict=True):
        dot = sum(a * b for a, b in zip(g.embedding, w.embedding, strict=True))
        assert dot >= 0.9999  # both unit vectors: the cosine
    after = workers(disagg_stack)
    for wid, w in after.items():
        grew = w["num_prefills"] - before[wid]["num_prefills"]
        assert grew == (len(inputs) if w["role"] == "prefill" else 0), wid
        assert w["num_decodes"] == before[wid]["num_decodes"], wid
    assert stats(disagg_stack)["kv_transfers"] == transfers
    wait_all_blocks_free(disagg_stack)


def nats_url_of(name: str) -> str:
    log = (ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log").read_text()
    return re.search(r"kvflow: nats (nats://\S+),", log).group(1)


def test_a_joining_worker_gets_work_and_a_leaving_one_gets_no_more(disagg_stack, tokenizer) -> None:
    env = {
        **os.environ,
        "KVFLOW_NATS_URL": nats_url_of("disagg"),
        # the stack is closed: the new worker logs in with the worker role's credentials
        "KVFLOW_NATS_PASSWORD_FILE": str(stack_credentials("disagg").nats_password_file("worker")),
        "KVFLOW_ROLE": "decode",
        "KVFLOW_WORKER_ID": "decode-joined",
        "KVFLOW_KV_CACHE_MEMORY": "0.3",
        "KVFLOW_MAX_MODEL_LEN": "2048",
        "KVFLOW_THREADS": "1",
    }
    log = open(ROOT / ".pytest_cache" / "kvflow-joined-worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "run", "worker"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while "decode-joined" not in workers(disagg_stack):
            assert proc.poll() is None, "the joining worker exited"
            assert time.monotonic() < deadline, "the worker never joined"
            time.sleep(0.5)
        # unrelated requests at once: the newcomer, empty, is the cheapest place for some
        prompts = [long_prompt(tokenizer, 80, seed=30 + i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda p: complete(disagg_stack, p, 8), prompts))
        assert workers(disagg_stack)["decode-joined"]["num_decodes"] >= 1
        # a clean leave: SIGTERM drains it, the scheduler releases it, it exits by itself
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "decode-joined" not in workers(disagg_stack)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: complete(disagg_stack, p, 8), prompts[:4]))
        assert all(outs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    wait_all_blocks_free(disagg_stack)
