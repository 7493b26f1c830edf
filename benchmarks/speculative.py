"""``kvflow bench speculative``: speculative decoding (n-gram drafts) against plain decoding on
two workloads, at one stream and at ``--spec-streams`` streams: requests that quote or edit a
given text (lists with one item changed, code with a name changed, JSON with a value changed:
drafts from the prompt are right most of the time) and free-form prose (they rarely are).
Greedy, chat-templated prompts, the model's own end (EOS) honoured: both stacks generate the
same tokens, so time per output token (TPOT) and output tokens/s compare like for like. Each
configuration gets a ``kvflow serve`` of its own (``--serve-args`` for both); acceptance comes
from the stack's vLLM counters (``vllm:spec_decode_*``) around each run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvflow.benchmarks.client import RunSummary, run_load
from kvflow.shared.config import Settings
from kvflow.shared.model_source import load_tokenizer, resolve_model

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
FRUITS = "apple banana cherry grape lemon mango orange peach pear plum".split()
NAMES = "Alice Bob Carol David Erin Frank Grace Heidi".split()
TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "the first day of spring in a mountain village",
    "why people enjoy long train journeys",
    "a robot learning to paint",
    "the history of the bicycle",
    "a chef who loses her sense of taste",
    "what makes a good friend",
    "a storm at sea seen from the shore",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-config",
        action="append",
        default=None,
        help="a --speculative-config to test (repeat for several; default: n-gram, k=4)",
    )
    p.add_argument("--spec-streams", type=int, default=8, help="streams of the concurrent runs")
    p.add_argument("--spec-requests", type=int, default=8, help="requests per run and stream count")
    p.add_argument("--spec-max-tokens", type=int, default=160, help="max_tokens of each request")


def quoting_prompts(n: int) -> list[str]:
    """Requests to repeat a given text with one change."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            items = [FRUITS[(i + j) % len(FRUITS)] for j in range(6)]
            listing = "\n".join(f"{j + 1}. {x}" for j, x in enumerate(items))
            out.append(
                f"Repeat the following list exactly, but replace '{items[2]}' with 'kiwi':\n"
                f"{listing}"
            )
        elif kind == 1:
            name = NAMES[i % len(NAMES)].lower()
            code = (
                f"def total_{name}(prices, tax):\n    subtotal = 0\n    for price in prices:\n"
                f"        subtotal = subtotal + price\n    result = subtotal * (1 + tax)\n"
                f"    return result\n"
            )
            out.append(
                "Rewrite this Python function with the variable `subtotal` renamed to `acc`. "
                f"Output only the code.\n\n{code}"
            )
        else:
            people = [
                {"name": NAMES[(i + j) % len(NAMES)], "age": 20 + 3 * j, "city": "Paris"}
                for j in range(3)
            ]
            out.append(
                f"Return this JSON unchanged except that {people[1]['name']}'s age is 99:\n"
                f"{json.dumps(people, indent=2)}"
            )
    return out


def prose_prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def _chat(tokenizer, text: str) -> str:  # noqa: ANN001
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _counters(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far."""
    drafts = accepted = 0.0
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_num_draft_tokens_total":
                drafts += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_total":
                accepted += s.value
    return drafts, accepted


def _run(
    url: str, model: str, prompts: list[str], streams: int, max_tokens: int, name: str
) -> tuple[RunSummary, float]:
    d0, a0 = _counters(url)
    work: list[tuple[str | list[int], int]] = [(p, max_tokens) for p in prompts]
    summary = asyncio.run(
        run_load(url, model, work, streams, name=name, ignore_eos=False, warmup=prompts[:1])
    )
    d1, a1 = _counters(url)
    return summary, (a1 - a0) / (d1 - d0) if d1 > d0 else float("nan")


def main(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.stack import start_stack

    src = resolve_model(args.model)
    tok = load_tokenizer(src, Settings.from_env().ops.cache_root())
    n, streams = args.spec_requests, args.spec_streams
    workloads = {
        "quoting": [_chat(tok, p) for p in quoting_prompts(max(n, streams * 2))],
        "prose": [_chat(tok, p) for p in prose_prompts(max(n, streams * 2))],
    }
    configs: dict[str, list[str]] = {"off": []}
    for i, raw in enumerate(args.spec_config or [DEFAULT_SPEC]):
        configs[f"{json.loads(raw)['method'].split('_')[0]}{i or ''}"] = [
            "--speculative-config",
            raw,
        ]
    rows = []
    for cname, flags in configs.items():
        print(f"starting kvflow serve (speculation {cname}) ...", flush=True)
        proc, url = start_stack(args.serve_args.split() + flags)
        try:
            for wname, prompts in workloads.items():
                for c in (1, streams):
                    sub = prompts[: n if c == 1 else streams * 2]
                    s, acc = _run(url, src.name, sub, c, args.spec_max_tokens, f"{wname}/{cname}")
                    rows.append((wname, c, cname, s, acc))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    print()
    for cname, flags in configs.items():
        print(f"{cname}: {flags[1] if flags else 'no speculation'}")
    head = f"{'workload':<9} {'streams':>7} {'spec':>6} {'tokens':>7} {'tok/s':>8} "
    print(head + f"{'TPOT p50 ms':>12} {'accept':>7} {'TPOT vs off':>12}")
    off = {(w, c): s for w, c, cn, s, _ in rows if cn == "off"}
    for w, c, cn, s, acc in rows:
        base = off[(w, c)]
        ratio = base.tpot_p50_s / s.tpot_p50_s if s.tpot_p50_s else float("nan")
        print(
            f"{w:<9} {c:>7} {cn:>6} {s.output_tokens:>7} {s.output_tokens_per_s:>8.1f} "
            f"{s.tpot_p50_s * 1000:>12.1f} {acc:>7.2f} {ratio:>11.2f}x"
        )
    return 0
