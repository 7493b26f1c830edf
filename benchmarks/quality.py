"""``kvflow bench quality``: what each ``--quantization`` costs in accuracy, against the fp32
default on the same model: perplexity over a text of a few thousand tokens and how often the
top-1 next-token prediction agrees with fp32's, teacher-forced over the same text.

The text is CPython's own documentation topics (``pydoc_data.topics``, shipped with every
Python), cut into windows of ``--window`` tokens; each window is one prompt whose
prompt logprobs the worker's ModelRunner computes, as in serving (chunked prefill, the same
kernels). Nothing is downloaded.

``--second-half`` scores only the second half of each window, as llama.cpp's ``llama-perplexity``
does (each prediction then has at least half a window of context), and ``--text-out`` writes the
windows' text, so that tool can be run on the same text for a side-by-side figure (a model whose
tokenizer adds a BOS gets it as llama-perplexity gives it: in front of the text and in place of
each window's first token). ``fp8`` is
the GPU path's scheme; here its GEMMs run through torch's CPU fallback of ``_scaled_mm`` (the
same rounding of both operands as cuBLASLt, slower), so its accuracy is measured without a
GPU."""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvflow.shared.messages import NewRequest, SamplingParams, ScheduledSeq, StepPlan

SCHEMES = ("", "gguf", "gguf-a8", "int8", "w8a8", "fp8")
BLOCK = 16


def bos_id(tokenizer) -> int | None:  # noqa: ANN001
    """The BOS the tokenizer puts in front of a prompt (Gemma's ``<bos>``), None if it adds none
    (SmolLM2)."""
    ids = tokenizer("")["input_ids"]
    return ids[0] if ids and ids[0] == tokenizer.bos_token_id else None


def corpus_tokens(tokenizer, num_tokens: int, window: int) -> list[int]:  # noqa: ANN001
    """The documentation topics' token ids in sorted topic order, cut to whole windows; BOS in
    front where the tokenizer adds one (as llama-perplexity tokenizes its text file)."""
    from pydoc_data.topics import topics

    bos = bos_id(tokenizer)
    ids: list[int] = [] if bos is None else [bos]
    for name in sorted(topics):
        ids += tokenizer(topics[name], add_special_tokens=False)["input_ids"]
        if len(ids) >= num_tokens:
            break
    return ids[: num_tokens - num_tokens % window]


def corpus_ids(tokenizer, num_tokens: int, window: int) -> list[list[int]]:  # noqa: ANN001
    """Windows of ``window`` token ids of ``corpus_tokens``. Where the tokenizer adds a BOS,
    each window starts with it in place of its first token, as llama-perplexity's chunks do:
    a model trained always to see BOS first (Gemma) predicts badly without it."""
    ids = corpus_tokens(tokenizer, num_tokens, window)
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    bos = bos_id(tokenizer)
    return windows if bos is None else [[bos, *w[1:]] for w in windows]


def prompt_predictions(  # noqa: ANN201
    runner,  # noqa: ANN001
    windows: list[list[int]],
    first: int = 1,
) -> tuple[list[float], list[int]]:
    """(logprob of each actual token from position ``first`` of its window on, top-1 id at
    each of those positions)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    logprobs: list[float] = []
    top1: list[int] = []
    chunk = 256
    for w, ids in enumerate(windows):
        rid = f"q{w}"
        table = list(range(-(-len(ids) // BLOCK)))
        new = [NewRequest(rid, params, len(ids))]
        got: dict[int, tuple[float, int]] = {}
        for start in range(0, len(ids), chunk):
            seq = ScheduledSeq(rid, ids[start : start + chunk], start, table)
            res = runner.execute(StepPlan(w * 100 + start, [seq], new))
            new = []
            if res.error:
                raise RuntimeError(res.error)
            for piece in res.prompt_logprobs:
                for i, (lp, tops) in enumerate(zip(piece.logprobs, piece.top_ids, strict=True)):
                    got[piece.start + i] = (lp, tops[0] if tops else -1)
        runner.execute(StepPlan(w * 100 + 99, [], [], [rid]))
        for pos in range(max(1, first), len(ids)):
            lp, top = got[pos]
            logprobs.append(lp)
            top1.append(top)
    return logprobs, top1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=3072, help="text length in tokens")
    p.add_argument("--window", type=int, default=512, help="tokens per prompt")
    p.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        help="comma-separated --quantization values, or bf16 (--dtype bfloat16: the CPU path's "
        "bf16 GEMMs); the first is the baseline ('' = fp32)",
    )
    p.add_argument(
        "--second-half",
        action="store_true",
        help="score only each window's second half (llama.cpp's llama-perplexity method)",
    )
    p.add_argument("--text-out", default="", help="also write the windows' text to this file")


def main(args: argparse.Namespace) -> int:
    from kvflow.services.worker import machine
    from kvflow.services.worker.model_loader import load_weights
    from kvflow.services.worker.runner import ModelRunner
    from kvflow.shared.config import Settings
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import load_tokenizer, resolve_model

    machine.configure(Settings.from_env())  # before any kernel loads
    src = resolve_model(args.model)
    cfg = load_config(src)
    tokenizer = load_tokenizer(src, machine.cache_dir())
    windows = corpus_ids(tokenizer, args.tokens, args.window)
    first = args.window // 2 if args.second_half else 1
    n = sum(len(w) - first for w in windows)
    print(f"{src.name}: {len(windows)} windows of {args.window} tokens ({n} predicted positions)")
    if args.text_out:
        ids = corpus_tokens(tokenizer, args.tokens, args.window)
        if bos_id(tokenizer) is not None:
            ids = ids[1:]  # llama-perplexity puts its own BOS in front of the file's text
        text = tokenizer.decode(ids)
        with open(args.text_out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"text written to {args.text_out}")
    base: tuple[float, list[int]] | None = None
    rows = []
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        bf16 = scheme == "bf16"
        weights = load_weights(src, cfg, quantization="" if bf16 else scheme)
        num_blocks = -(-args.window // BLOCK) + 1
        kw = {"dtype": torch.bfloat16} if bf16 else {}
        runner = ModelRunner.from_weights(cfg, weights, BLOCK, num_blocks, **kw)
        lps, top1 = prompt_predictions(runner, windows, first)
        ppl = math.exp(-sum(lps) / len(lps))
        if base is None:
            base = (ppl, top1)
        agree = sum(a == b for a, b in zip(top1, base[1], strict=True)) / len(top1)
        name = scheme or "fp32"
        rows.append((name, ppl, 100 * (ppl / base[0] - 1), 100 * agree))
        print(f"  {name}: perplexity {ppl:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(f"| weights | perplexity | vs {rows[0][0]} | top-1 agreement with {rows[0][0]} |")
    print("|---|---:|---:|---:|")
    for name, ppl, delta, agree in rows:
        print(f"| {name} | {ppl:.3f} | {delta:+.2f} % | {agree:.2f} % |")
    return 0
