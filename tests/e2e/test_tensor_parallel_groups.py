"""Tensor-parallel workers (``--tensor-parallel-size``) on SmolLM2 with gloo on this CPU, through
``LLM(tensor_parallel_size=N)`` (its own pipeline: real nats-server and services, each worker
rank a real process): greedy output over 2 and 3 ranks equals Hugging Face transformers' (and so
the one-rank worker's, which the rest of the suite holds to it), alone and in shared batches, and with a LoRA adapter (cut per rank) equals transformers +
peft's; and a follower rank killed with SIGKILL mid-generation takes its worker down while the requests
it ran finish on the other worker with the same text (migration)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvflow import LLM, LoRARequest, SamplingParams
from tests.helpers.faults import MODEL, service_pids, stack_urls
from tests.helpers.lora_stack import NEW_TOKENS as LORA_TOKENS
from tests.helpers.lora_stack import PROMPTS as LORA_PROMPTS
from tests.helpers.lora_stack import greedy_text, make_adapter
from tests.helpers.stack import (
    NEW_TOKENS,
    ROOT,
    hf_greedy_texts,
    long_prompt,
    openai_client,
    running_stack,
    stats,
    timed,
    wait_for,
)
from tests.helpers.stack import PROMPTS as ENGINE_PROMPTS

pytestmark = pytest.mark.e2e

# the engine tests' prompts and more of other kinds
PROMPTS = ENGINE_PROMPTS + [
    "Write a haiku about rain.",
    "2 + 2 =",
    "The quick brown fox",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef normalize(x):",
]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tokenizer):
    return hf_greedy_texts(hf_model, tokenizer, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def adapter(hf_model, tokenizer, tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A rank-8 PEFT adapter on every projection, and transformers + peft's greedy texts."""
    path = tmp_path_factory.mktemp("tp-lora") / "sql"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = make_adapter(hf_model, path, 1, 8, targets)
    return str(path), {p: greedy_text(model, tokenizer, p) for p in LORA_PROMPTS}


@pytest.mark.parametrize("ranks", [3])
def test_greedy_output_over_ranks_equals_transformers(ranks: int, hf_greedy, adapter) -> None:
    """Base requests alone and batched, and requests with a LoRA adapter (cut per rank as the
    weights are) in the same batches as base ones. Three ranks: uneven cuts of the heads and of
    the MLP (two ranks' greedy text is checked by the int8 and disaggregated tests below, and
    per layer by tests/integration/worker/test_tensor_parallel_families.py)."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    path, peft_texts = adapter
    sql = LoRARequest("sql", 1, path)
    lora_greedy = SamplingParams(temperature=0, max_tokens=LORA_TOKENS)
    with LLM(
        tensor_parallel_size=ranks, max_model_len=1024, kv_cache_memory=0.1, enable_lora=True
    ) as llm:
        alone = [llm.generate([p], greedy, use_tqdm=False)[0] for p in PROMPTS[:3]]
        batched = llm.generate(PROMPTS, greedy, use_tqdm=False)  # all in shared steps
        mixed = LORA_PROMPTS + PROMPTS[:2]  # adapter and base rows in the same steps
        lora = [sql] * len(LORA_PROMPTS) + [None, None]
        with_lora = llm.generate(mixed, lora_greedy, use_tqdm=False, lora_request=lora)
        # random sampling: every rank draws the same numbers (their streams start alike), so
        # the followers' request states stay rank 0's and the group keeps stepping together
        sampled = llm.generate(
            PROMPTS, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False
        )
        seeded = [
            llm.generate(
                [PROMPTS[0]], SamplingParams(temperature=1.0, seed=7, max_tokens=16), use_tqdm=False
            )[0]
            for _ in range(2)
        ]
        after = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0]
        log = Path(llm._stack.log_path).read_text()  # type: ignore[union-attr]
    assert f"tensor-parallel group ready: {ranks} ranks" in log
    for out in alone + batched:
        got = out.outputs[0]
        assert (got.text, len(got.token_ids)) == hf_greedy[out.prompt], (ranks, out.prompt)
    for out in with_lora[: len(LORA_PROMPTS)]:
        assert out.outputs[0].text == peft_texts[out.prompt], (ranks, out.prompt)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in sampled)
    assert seeded[0].outputs[0].text == seeded[1].outputs[0].text
    assert after.outputs[0].text == hf_greedy[PROMPTS[0]][0]


def _follower_of(worker_pid: int) -> int:
    """The pid of the worker's rank-1 process (its spawned child)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and b"spawn_main" in cmdline:
            return int(entry)
    raise AssertionError(f"worker {worker_pid} has no rank process")


def test_a_killed_rank_takes_its_worker_down_and_requests_finish_elsewhere() -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = PROMPTS[:6]
    with LLM(workers=2, tensor_parallel_size=2, max_model_len=1024, kv_cache_memory=0.1) as llm:
        stack = llm._stack
        assert stack is not None
        reference = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        got: list = []
        run = threading.Thread(
            target=lambda: got.extend(llm.generate(prompts, params, use_tqdm=False))
        )
        run.start()
        deadline = time.monotonic() + 120
        while True:  # both workers run some of the requests, a few tokens in
            stats = llm._loop.run(llm._client.stats())
            if stats.num_computed_tokens and all(w.num_running for w in stats.workers):
                break
            assert time.monotonic() < deadline, "the requests did not start on both workers"
            time.sleep(0.05)
        time.sleep(0.5)
        victim, other = (w.worker_id for w in stats.workers)
        worker_pid = service_pids(stack.nats_url)[f"worker:{victim}"]
        os.kill(_follower_of(worker_pid), signal.SIGKILL)
        run.join(300)
        assert not run.is_alive()
        log = Path(stack.log_path).read_text()  # type: ignore[arg-type]
        remaining = llm._loop.run(llm._client.stats()).workers
    assert [o.outputs[0].text for o in got] == reference
    assert "tensor-parallel rank 1 exited" in log
    assert f"{victim}: no heartbeat" in log  # the scheduler gave it up and moved its work
    assert [w.worker_id for w in remaining] == [other]  # the LLM's pipeline restarts nothing
    kept = Path(stack.log_path)  # type: ignore[arg-type]
    assert kept.exists()  # a process failed: the pipeline's log stays for the user to read
    shutil.rmtree(kept.parent)


def test_int8_weights_over_2_ranks_equal_int8_on_one(model_src, tokenizer) -> None:
    """--quantization int8 rounds each rank's cut of the weights, in blocks of 32 that start
    where the whole model's do (head and feature boundaries are multiples of 32 here): the same
    weights as one int8 worker, whose greedy tokens come from the runner in this process."""
    from kvflow.services.worker.model_loader import load_weights, quantize_int8
    from kvflow.services.worker.runner import ModelRunner
    from kvflow.shared.model_config import load_config
    from tests.helpers.smollm2 import BLOCK, generate

    cfg = load_config(model_src)
    runner = ModelRunner.from_weights(
        cfg, quantize_int8(load_weights(model_src, cfg)), BLOCK, num_blocks=64
    )
    prompts = PROMPTS[:4]
    want, _ = generate(runner, [tokenizer(p)["input_ids"] for p in prompts])  # 32 tokens
    del runner
    greedy = SamplingParams(temperature=0, max_tokens=32)
    with LLM(tensor_parallel_size=2, quantization="int8", max_model_len=1024) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    for out, tokens in zip(outs, want, strict=True):
        assert out.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_disaggregated_groups_move_and_tier_every_rank_s_kv(hf_greedy, tokenizer) -> None:
    """`kvflow serve --prefill-workers 1 --decode-workers 1 --tensor-parallel-size 2
    --kv-redis-tier`: a block moved between the groups, or stored in and loaded from Redis, is
    every rank's part of it (rank 0 maps the others' caches: services/worker/kv_blocks.py).
    Prefilled on one group and decoded on the other, greedy text equals transformers'; after
    the prefill group is killed and started again, a long prompt's blocks come from Redis
    and its text is unchanged."""
    args = ["--prefill-workers", "1", "--decode-workers", "1", "--tensor-parallel-size", "2"]
    args += ["--kv-redis-tier", "--kv-cache-memory", "0.3", "--max-model-len", "1024"]
    name = "tp-disagg"
    with running_stack(name, *args) as base:
        client = openai_client(base)

        def complete(p: str) -> tuple[str, int]:
            r = client.completions.create(
                model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0
            )
            return r.choices[0].text, r.usage.completion_tokens

        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            texts = list(ex.map(complete, PROMPTS))
        assert texts == [hf_greedy[p] for p in PROMPTS]
        assert stats(base)["kv_transfers"] >= len(PROMPTS)
        assert [w["tensor_parallel_size"] for w in stats(base)["workers"]] == [2, 2]
        log = (ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log").read_text()
        assert "layout float32:30x16x5+4x64" in log  # both groups: rank 0's 5 KV heads + 4

        prompt = long_prompt(tokenizer, 400, seed=3)  # 25 full blocks
        first, _ = timed(base, prompt)
        wait_for(lambda: any(w["redis_stored_blocks"] >= 25 for w in stats(base)["workers"]))
        nats_url, _ = stack_urls(name)
        old = service_pids(nats_url)["worker:prefill-0"]
        os.kill(old, signal.SIGKILL)  # its rank 1 follows it down
        wait_for(lambda: service_pids(nats_url).get("worker:prefill-0", old) != old, 60)
        wait_for(lambda: _fresh_prefill_worker(base), 180, "the new prefill group to join")
        before = stats(base)
        second, _ = timed(base, prompt)
        hits = stats(base)["tier_redis_hits"] - before["tier_redis_hits"]
    assert second == first
    assert hits >= 20


def _fresh_prefill_worker(base: str) -> bool:
    try:
        workers = stats(base)["workers"]
    except httpx.HTTPError:
        return False
    prefill = [w for w in workers if w["role"] == "prefill"]
    return (
        len(prefill) == 1 and prefill[0]["num_prefills"] == 0 and prefill[0]["redis_tier"] == "on"
    )
