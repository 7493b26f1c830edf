"""The worker's sampling of one step, alone: ``python -m kvflow.benchmarks.sampling``.

Times ``services/worker/sampler.py``'s ``sample_rows`` (every processor the rows turned on,
temperature, top-k/top-p/min-p, the draw, logprobs, and the copy of the ids to the host) on
``--rows`` random logits rows of ``--vocab`` (SmolLM2's 49,152 by default), for three mixes:

- ``greedy``: temperature 0 (one argmax);
- ``hot``: temperature 0.8, top_p 0.95, top_k 50 (a chat client's defaults);
- ``full``: ``hot`` plus a seed, repetition/presence/frequency penalties, a logit bias and 5
  logprobs (128 prompt and 32 output tokens of history per row).

``--device cuda`` samples on the GPU where the logits are (the worker's path) and, as ``host``,
after copying the logits to the CPU first (what the worker did before sampling moved to the
device: every row with temperature, logprobs or a processor went that way). Prints the median
milliseconds per step over ``--steps`` after warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kvflow.services.worker.runner import RequestState
from kvflow.services.worker.sampler import sample_rows
from kvflow.shared.messages import SamplingParams
from kvflow.shared.sampling import needs_token_history

HOT = dict(temperature=0.8, top_p=0.95, top_k=50)
MIXES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "hot": HOT,
    "full": HOT
    | dict(
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias={11: 1.5, 12: -2.0},
        logprobs=5,
    ),
}


def _states(mix: str, rows: int, vocab: int, prompt_len: int = 128) -> list[RequestState]:
    rnd = random.Random(rows)
    out = []
    for i in range(rows):
        seeded = mix == "full"
        p = SamplingParams(max_tokens=64, seed=i if seeded else None, **MIXES[mix])
        st = RequestState(p, prompt_len, 32, frozenset([2]), frozenset(), needs_token_history(p))
        if st.keeps_history:
            st.prompt_tokens = [rnd.randrange(vocab) for _ in range(prompt_len)]
            st.output_tokens = [rnd.randrange(vocab) for _ in range(32)]
        out.append(st)
    return out


def time_step(
    rows: int,
    vocab: int,
    mix: str,
    device: torch.device,
    host: bool,
    steps: int,
    warmup: int,
    prompt_len: int = 128,
) -> float:
    """Median milliseconds of one step's sampling (logits made on ``device``; ``host``:
    copied to the CPU first and sampled there). Each step's tokens join the outputs of the
    requests that keep their history (penalties), as on the worker."""
    states = _states(mix, rows, vocab, prompt_len)
    base = torch.randn(rows, vocab, device=device, generator=None) * 3
    times = []
    for k in range(warmup + steps):
        logits = base.clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if host:
            logits = logits.cpu()
        positions = [st.num_output_tokens for st in states]
        tokens, _ = sample_rows(logits, states, positions)  # ends with the ids' copy (a sync)
        if k >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        assert len(tokens) == rows
        for st, t in zip(states, tokens, strict=True):
            st.num_output_tokens += 1
            if st.keeps_history:
                st.output_tokens.append(t)
    return statistics.median(times)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="One step's sampling, timed (CPU or CUDA).")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument(
        "--prompt-len", type=int, default=128, help="prompt tokens of the penalised rows' history"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from kvflow.services.worker.device import resolve_device

    device = resolve_device(args.device)
    modes = ["device", "host"] if device.type == "cuda" else ["device"]
    print(
        f"sampling one step, {args.vocab} vocab, prompts of {args.prompt_len} tokens, on "
        f"{device} (torch {torch.__version__})"
    )
    print(f"{'rows':>5} {'mix':>7} " + " ".join(f"{m + ' ms':>10}" for m in modes))
    results = []
    for rows in args.rows:
        for mix in args.mix:
            ms = {
                m: time_step(
                    rows,
                    args.vocab,
                    mix,
                    device,
                    m == "host",
                    args.steps,
                    args.warmup,
                    args.prompt_len,
                )  # fmt: skip
                for m in modes
            }
            print(f"{rows:>5} {mix:>7} " + " ".join(f"{ms[m]:>10.3f}" for m in modes), flush=True)
            results.append({"rows": rows, "mix": mix} | {f"{m}_ms": ms[m] for m in modes})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
