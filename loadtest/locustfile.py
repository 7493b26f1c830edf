"""Locust load test for kvflow's OpenAI API (any OpenAI-compatible server works).

Each user streams chat completions drawn from a mix of request shapes (short chat, long prompt
with a short answer, short prompt with a long answer), with ``ignore_eos`` so that every
request generates exactly the output length it drew, as vLLM's benchmarks do. Besides Locust's
own row for the POST (time until the response headers), every request records custom request
events:

- ``TTFT``: time to first token (first content delta), one per request;
- ``ITL``: inter-token latency, one per content delta after the first;
- ``E2E``: the whole request, its "content size" being the number of output tokens.

A request's events are fired together when it ends (timings are taken as the deltas arrive), so
a request still in flight when Locust writes its final CSV is in none of the rows rather than
in some.

Run it with ``make loadtest URL=http://127.0.0.1:8000 USERS=8 DURATION=60s`` or directly:
``locust -f loadtest/locustfile.py --headless --host URL -u 8 -r 2 -t 60s``.

Environment: ``LOADTEST_MODEL`` (default SmolLM2-135M-Instruct), ``LOADTEST_SCALE`` (multiplies
prompt and output lengths; 0.25 for a quick smoke run), ``LOADTEST_SEED``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from dataclasses import dataclass

from locust import HttpUser, between, task

MODEL = os.environ.get("LOADTEST_MODEL", "SmolLM2-135M-Instruct")
SCALE = float(os.environ.get("LOADTEST_SCALE", "1"))
SEED = int(os.environ.get("LOADTEST_SEED", "0"))
NAME = "/v1/chat/completions"
_USER_IDS = itertools.count()

_WORDS = (
    "the system stores every cache block once and shares it between requests whose prompts "
    "begin with the same tokens while the scheduler decides which sequences run in each step "
    "under a budget of tokens and the workers compute attention over pages of keys and values "
    "that live in a pool of fixed size blocks so that memory is not wasted on padding and new "
    "requests can join a running batch at any step instead of waiting for the batch to finish"
).split()


@dataclass(frozen=True)
class Shape:
    """A kind of request: weight in the mix, prompt words and output tokens (ranges)."""

    name: str
    weight: int
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]


SHAPES = (
    Shape("chat", 6, (15, 60), (32, 128)),  # a question and a paragraph of answer
    Shape("long-prompt", 2, (300, 700), (16, 64)),  # summarise / answer from a document
    Shape("long-output", 1, (10, 30), (192, 384)),  # write something long
)


def _scaled(lo_hi: tuple[int, int], rng: random.Random) -> int:
    return max(1, round(rng.randint(*lo_hi) * SCALE))


def make_request(rng: random.Random) -> tuple[Shape, dict]:
    """One chat completion request body, drawn from the mix."""
    shape = rng.choices(SHAPES, weights=[s.weight for s in SHAPES])[0]
    text = " ".join(rng.choice(_WORDS) for _ in range(_scaled(shape.prompt_words, rng)))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Read this and continue it: {text}"}],
        "max_tokens": _scaled(shape.output_tokens, rng),
        "ignore_eos": True,  # vLLM extra: generate exactly max_tokens
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return shape, body


class ChatStreamUser(HttpUser):
    """Streams chat completions, with a short think time between requests."""

    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random(SEED * 100_003 + next(_USER_IDS))

    def _event(self, kind: str, seconds: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=NAME,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=None,
            context={},
        )

    @task
    def stream_chat(self) -> None:
        _, body = make_request(self.rng)
        start = time.perf_counter()
        first: float | None = None
        last = start
        gaps: list[float] = []
        usage_tokens: int | None = None
        done = False
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            stream=True,
            catch_response=True,
            name=f"{NAME} (headers)",
            timeout=600,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    resp.failure(f"error in stream: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", ()):
                    if not choice.get("delta", {}).get("content"):
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            if not done:
                resp.failure("stream ended without [DONE]")
                return
            if first is None:
                resp.failure("no content in the stream")
                return
            tokens = usage_tokens if usage_tokens is not None else len(gaps) + 1
            if tokens != body["max_tokens"]:
                resp.failure(f"{tokens} output tokens, asked for {body['max_tokens']}")
                return
            end = time.perf_counter()
            self._event("TTFT", first - start)
            for gap in gaps:
                self._event("ITL", gap)
            self._event("E2E", end - start, tokens)
            resp.success()  # Locust reports the POST (time to headers) as the block exits
