"""TTFT of a long prompt computed, against the same prompt after a worker restart served from the
Redis KV tier (and, for comparison, from the worker's own prefix cache).

    python -m kvflow.benchmarks.tiers [--prompt-tokens 1000] [--repeats 3]

It starts `kvflow serve --kv-redis-tier`, sends a prompt of real text (cold: computed), again
(warm: the worker's prefix cache), then SIGKILLs the worker, waits for `kvflow serve` to start it
again, and sends it once more (Redis tier: loaded instead of recomputed). Each figure is the
median of ``--repeats`` prompts; it also prints the tokens computed and the blocks loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvflow.shared.config import Settings
from kvflow.shared.infra import free_port, wait_for_http
from kvflow.shared.model_source import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parents[1]


def ttft(base: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


def worker_pid(nats_url: str) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if f"KVFLOW_NATS_URL={nats_url}".encode() in env and b"run\x00worker" in cmd:
            return int(entry)
    raise RuntimeError("no worker process found")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.benchmarks.tiers", description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    src = resolve_model()
    tok = load_tokenizer(src, Settings.from_env().ops.cache_root())
    words = ["harbor", "signal", "copper", "meadow", "lantern", "orchard", "valley", "ember"]
    prompts = [
        tok(" ".join(f"{words[(i * 3 + k) % 8]} {i}," for i in range(args.prompt_tokens)))[
            "input_ids"
        ][: args.prompt_tokens]
        for k in range(args.repeats)
    ]
    port = free_port()
    log_path = ROOT / "bench-results" / "bench-tiers-serve.log"
    log_path.parent.mkdir(exist_ok=True)
    serve = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port)]
    serve += ["--kv-redis-tier", "--max-model-len", str(args.prompt_tokens + 64)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        print("starting kvflow serve --kv-redis-tier ...", flush=True)
        wait_for_http(f"{base}/health", proc, "kvflow serve")
        nats_url = re.search(r"kvflow: nats (nats://\S+),", log_path.read_text()).group(1)
        ttft(base, src.name, prompts[0][:50])  # warm-up
        stats = lambda: httpx.get(f"{base}/stats", timeout=5).json()  # noqa: E731
        cold = [ttft(base, src.name, pr) for pr in prompts]
        cached = [ttft(base, src.name, pr) for pr in prompts]
        time.sleep(2)  # the last stores reach Redis
        old = worker_pid(nats_url)
        os.kill(old, signal.SIGKILL)
        print("worker SIGKILLed; waiting for kvflow serve to start it again ...", flush=True)
        while True:
            time.sleep(0.5)
            try:
                w = stats()["workers"]
            except httpx.HTTPError:
                continue
            if len(w) == 1 and w[0]["num_prefills"] == 0 and w[0]["redis_tier"] == "on":
                break
        ttft(base, src.name, [1, 2, 3])  # the new worker's first step (oneDNN warm-up)
        before = stats()
        redis = [ttft(base, src.name, pr) for pr in prompts]
        after = stats()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    med = statistics.median
    n = args.repeats
    computed = (after["num_computed_tokens"] - before["num_computed_tokens"]) / n
    loaded = (after["tier_redis_hits"] - before["tier_redis_hits"]) / n
    secs = (after["tier_load_seconds"] - before["tier_load_seconds"]) / n
    print(f"\n{args.prompt_tokens}-token prompts, median of {n}, TTFT (s):\n")
    print("| path | TTFT (s) |")
    print("|---|---:|")
    print(f"| computed (cold) | {med(cold):.2f} |")
    print(f"| worker's prefix cache | {med(cached):.2f} |")
    print(f"| after a worker restart, from Redis | {med(redis):.2f} |")
    print(
        f"\nfrom Redis: {loaded:.0f} blocks loaded per prompt in {secs:.2f} s, "
        f"{computed:.0f} tokens computed per prompt"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
