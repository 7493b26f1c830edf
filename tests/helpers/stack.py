"""The whole stack as a user starts it, for tests/e2e: `kvflow serve` as a child process
(embedded nats-server and redis-server, every service its own process) on a free port, and what
the tests ask of a running stack (a client, its counters, HF's greedy texts, prompts)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from kvflow.shared.infra import free_port
from tests.helpers import hf_reference
from tests.helpers.paths import ROOT

# stacks told to stop (SIGTERM) and not yet waited for: each drains while the tests go on, and
# the session's end waits for them together (one after another, each ~3 s or more, added up)
_STOPPING: dict[str, tuple[subprocess.Popen, object]] = {}  # by stack name (its log file)


def _reap(proc: subprocess.Popen, log: object) -> None:
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def wait_for_stopping_stacks() -> None:
    """Wait for every stack told to stop (tests/e2e/conftest.py calls it at the session's end)."""
    while _STOPPING:
        _reap(*_STOPPING.popitem()[1])


@contextlib.contextmanager
def running_stack(name: str, *args: str):
    """`kvflow serve ARGS` on a free port until the block exits; yields the base URL."""
    if name in _STOPPING:  # the same name's last stack writes the same log: let it finish
        _reap(*_STOPPING.pop(name))
    port = free_port()
    log_path = ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"kvflow serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"stack not ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)  # waited for at the session's end
        _STOPPING[name] = (proc, log)


def openai_client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def wait_all_blocks_free(base: str, timeout: float = 10.0) -> dict:
    """The scheduler's counters once nothing runs: every KV block must be free again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base}/stats", timeout=5).json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            if stats["num_free_blocks"] == stats["num_total_blocks"] or time.monotonic() > deadline:
                return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


GUARDED_KEY = "sk-static-e2e"


def hf_greedy_texts(hf_model, tokenizer, prompts: list[str], new_tokens: int) -> dict:
    """Hugging Face's greedy continuation of each prompt: {prompt: (text, token count)}
    (tests/helpers/hf_reference.py: computed once on a machine)."""
    out = {}
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        (new,) = hf_reference.generate(hf_model, ids, max_new_tokens=new_tokens, do_sample=False)
        out[p] = (tokenizer.decode(new, skip_special_tokens=True), len(new))
    return out


MODEL = "SmolLM2-135M-Instruct"


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=5).json()


def complete(base: str, prompt, max_tokens: int, **kw) -> tuple[str, int]:
    r = openai_client(base).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=kw.pop("temperature", 0),
        **kw,
    )
    return r.choices[0].text, r.usage.completion_tokens


def text_prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of ordinary English text (numbered sentences), deterministic."""
    words = ["river", "stone", "garden", "lamp", "winter", "market", "letter", "cloud", "bridge"]
    parts, i = [], seed
    while True:
        parts.append(f"Note {i}: the {words[i % 9]} near the {words[(i * 4 + 1) % 9]} was quiet.")
        ids = tokenizer(" ".join(parts))["input_ids"]
        if len(ids) >= n:
            return ids[:n]
        i += 1


def timed(base: str, prompt, max_tokens: int = 16) -> tuple[str, float]:
    """Text and time to first token of a streamed greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    t0, ttft, text = time.perf_counter(), None, []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("text") and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c.get("text", ""))
    return "".join(text), ttft or time.perf_counter() - t0


def long_prompt(tokenizer, n: int, seed: int) -> list[int]:
    words = ["harbor", "signal", "copper", "meadow", "lantern", "orchard", "valley", "ember"]
    return tokenizer(" ".join(f"{words[(i * 3 + seed) % 8]} {i}," for i in range(n)))["input_ids"][
        :n
    ]


def wait_for(cond, timeout: float = 120, what="condition") -> None:
    """``what``: a text, or a function giving one (the state when the wait ran out)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.3)


NEW_TOKENS = 32


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three uses of copper:\n1.",
    "Translate to French: 'Good morning, my friend.' ->",
]
