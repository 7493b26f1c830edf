"""``kvflow bench embeddings``: embeddings per second through /v1/embeddings for inputs of a fixed
length (64 tokens by default, given as token ids so every input is exactly that long), three
ways: one input per request, sent one after another (batch 1); one request of ``--embed-batch``
inputs; and ``--embed-batch`` single-input requests in flight at once. Against a running stack
(``--url``) or a ``kvflow serve`` it starts (``--serve-args`` for its flags). For reference,
``--embed-hf`` also times, in process and after the server has stopped (the same cores, no
server): for a decoder, Hugging Face transformers' forward (the same pooled state); for an
encoder (an embedding model such as all-MiniLM-L6-v2), sentence-transformers' ``encode``; on the
same inputs, one at a time and as one batch. An encoder's inputs are sent as text (its
tokenizer adds [CLS] and [SEP]: ``--embed-len`` + 2 tokens), so both sides tokenize the same."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass

import httpx

from kvflow.shared.config import Settings
from kvflow.shared.model_source import load_tokenizer, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embed-len", type=int, default=64, help="tokens per input")
    p.add_argument("--embed-batch", type=int, default=64, help="inputs per batched request")
    p.add_argument("--embed-rounds", type=int, default=3, help="repetitions of each mode")
    p.add_argument(
        "--embed-hf", action="store_true", help="also time HF transformers' forward in process"
    )


@dataclass
class Mode:
    name: str
    embeddings: int
    seconds: float
    latencies: list[float]

    @property
    def per_s(self) -> float:
        return self.embeddings / self.seconds

    def row(self) -> str:
        p50 = statistics.median(self.latencies) * 1000
        return f"{self.name:<34} {self.embeddings:>6} {self.per_s:>10.1f} {p50:>14.0f}"


def inputs(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` different inputs of ``length`` token ids, slices of ordinary English text."""
    words = (
        "the river stone garden lamp winter market letter cloud bridge quiet morning city "
        "train book window light music story friend road sea mountain forest bird"
    ).split()
    text = " ".join(words[(i * 7) % len(words)] + f" {i}" for i in range(n * length))
    ids = tokenizer(text)["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(n)]


async def _post(client: httpx.AsyncClient, model: str, inp: list[list[int]] | list[str]) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/embeddings", json={"model": model, "input": inp})
    r.raise_for_status()
    assert len(r.json()["data"]) == len(inp)
    return time.perf_counter() - t0


async def measure(
    url: str, model: str, data: list[list[int]] | list[str], rounds: int
) -> list[Mode]:
    n = len(data)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _post(client, model, data[:4])  # warm-up
        modes = []
        lat: list[float] = []
        t0 = time.perf_counter()
        for _ in range(rounds):
            for x in data:
                lat.append(await _post(client, model, [x]))
        modes.append(
            Mode("1 input per request, sequential", n * rounds, time.perf_counter() - t0, lat)
        )
        lat = []
        t0 = time.perf_counter()
        for _ in range(rounds):
            lat.append(await _post(client, model, data))
        modes.append(Mode(f"{n} inputs in one request", n * rounds, time.perf_counter() - t0, lat))
        lat = []
        t0 = time.perf_counter()
        for _ in range(rounds):
            lat += await asyncio.gather(*(_post(client, model, [x]) for x in data))
        modes.append(
            Mode(f"{n} concurrent 1-input requests", n * rounds, time.perf_counter() - t0, lat)
        )
    return modes


def hf_modes(src, data: list[list[int]], rounds: int) -> list[Mode]:  # noqa: ANN001
    """HF LlamaModel's forward on the same inputs: one at a time, then all as one batch (equal
    lengths: no padding), last_hidden_state[:, -1] normalized, as the server pools."""
    import torch

    from kvflow.benchmarks.hf import load_hf

    model = load_hf(src).model
    n = len(data)

    def pooled(batch: list[list[int]]) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            h = model(torch.tensor(batch)).last_hidden_state[:, -1]
            torch.nn.functional.normalize(h, dim=-1)
        return time.perf_counter() - t0

    pooled(data[:4])  # warm-up
    one = [pooled([x]) for _ in range(rounds) for x in data]
    batched = [pooled(data) for _ in range(rounds)]
    return [
        Mode("HF forward, 1 input at a time", n * rounds, sum(one), one),
        Mode(f"HF forward, batch of {n}", n * rounds, sum(batched), batched),
    ]


def st_modes(src, texts: list[str], rounds: int) -> list[Mode]:  # noqa: ANN001
    """sentence-transformers' ``encode`` of the same texts: one at a time, then as one batch."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:  # a dev dependency (`make install` installs it)
        raise SystemExit(f"--embed-hf on an encoder needs sentence-transformers: {e}") from e

    model = SentenceTransformer(str(src.path), device="cpu")
    n = len(texts)

    def encode(batch: list[str]) -> float:
        t0 = time.perf_counter()
        model.encode(batch, batch_size=len(batch))
        return time.perf_counter() - t0

    encode(texts[:4])  # warm-up
    one = [encode([x]) for _ in range(rounds) for x in texts]
    batched = [encode(texts) for _ in range(rounds)]
    return [
        Mode("sentence-transformers, 1 at a time", n * rounds, sum(one), one),
        Mode(f"sentence-transformers, batch of {n}", n * rounds, sum(batched), batched),
    ]


def main(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.stack import start_stack
    from kvflow.shared.model_config import load_config
    from kvflow.shared.models.registry import family

    src = resolve_model(args.model)
    tok = load_tokenizer(src, Settings.from_env().ops.cache_root())
    ids = inputs(tok, args.embed_batch, args.embed_len)
    encoder = family(load_config(src).family).bidirectional
    data: list[list[int]] | list[str] = ids
    if encoder:  # texts of embed_len tokens (each re-tokenizes to them, plus [CLS] and [SEP])
        data = [tok.decode(x) for x in ids]
    proc, url = None, args.url
    if url is None:
        print("starting kvflow serve ...", flush=True)
        extra = args.serve_args.split()
        if args.model and "--model" not in extra:  # serve the model measured
            extra = ["--model", args.model, *extra]
        proc, url = start_stack(extra)
    try:
        modes = asyncio.run(measure(url, src.name, data, args.embed_rounds))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    if args.embed_hf:
        if encoder:
            modes += st_modes(src, data, args.embed_rounds)  # type: ignore[arg-type]
        else:
            modes += hf_modes(src, ids, args.embed_rounds)
    print(f"\ninputs of {args.embed_len} tokens, {args.embed_rounds} rounds per mode")
    print(f"{'mode':<34} {'inputs':>6} {'embeds/s':>10} {'p50 latency ms':>14}")
    for m in modes:
        print(m.row())
    return 0
