"""Helpers for fault-injection tests: find the processes of one `kvflow serve` stack (by the
NATS URL in their environment, so other stacks on the machine are never touched), read their
memory, and stream completions while recording every text piece."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvflow.benchmarks.chaos import rss_mib, service_pids  # noqa: F401 - the tests' too
from kvflow.shared.access.credentials import Credentials
from tests.helpers.stack import ROOT

MODEL = "SmolLM2-135M-Instruct"


def stack_urls(name: str) -> tuple[str, str]:
    """(nats URL, redis URL) that `kvflow serve` printed for the stack ``name``."""
    log = (ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log").read_text()
    m = re.search(r"kvflow: nats (nats://\S+), redis (redis\S*://\S+)", log)
    assert m, "no infrastructure URLs in the stack's log"
    return m.group(1), m.group(2)


def stack_credentials(name: str) -> Credentials:
    """The per-role credentials `kvflow serve` made for the stack ``name`` (it prints where)."""
    log = (ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log").read_text()
    m = re.search(r"kvflow: credentials \(one per role, removed at exit\): (\S+);", log)
    assert m, "no credentials directory in the stack's log"
    return Credentials(Path(m.group(1)))


def kvflow_keys(name: str, redis_url: str, *args: str) -> str:
    """`kvflow keys ARGS` as the admin role of the stack ``name``'s Redis."""
    admin = stack_credentials(name).redis_password_file("admin")
    env = {**os.environ, "KVFLOW_REDIS_URL": redis_url, "KVFLOW_REDIS_PASSWORD_FILE": str(admin)}
    out = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )
    return out.stdout.strip()


@dataclass
class Stream:
    """One streamed completion run in a thread; ``pieces`` grows as text arrives."""

    base: str
    prompt: str | list[int]
    max_tokens: int
    model: str = MODEL
    headers: dict[str, str] = field(default_factory=dict)  # an API key
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        import json

        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            url, h = f"{self.base}/v1/completions", self.headers
            with httpx.stream("POST", url, json=body, headers=h, timeout=600) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode()[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                        continue
                    for choice in chunk.get("choices", []):
                        self.pieces.append(choice.get("text", ""))
                        if choice.get("finish_reason"):
                            self.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"

    def join(self, timeout: float = 600) -> Stream:
        assert self.thread is not None
        self.thread.join(timeout)
        return self

    @property
    def text(self) -> str:
        return "".join(self.pieces)
