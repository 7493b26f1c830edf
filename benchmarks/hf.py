"""What a user would otherwise run on the same machine and model: Hugging Face transformers
``generate``, one request at a time and in static batches (left-padded, each batch running to its
longest request, as a static server must). Only useful tokens (each request's own max_tokens)
count towards throughput."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvflow.benchmarks.client import RequestStats, RunSummary, summarize
from kvflow.shared.infra import wait_for_http
from kvflow.shared.model_source import ModelSource


def load_hf(src: ModelSource):  # -> (model, pad_id)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(src.directory), gguf_file=src.path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32)
    return model.eval()


def _run_batch(model, batch: list[tuple[list[int], int]], pad_id: int) -> tuple[float, float]:
    """One static batch: (its prefill time, i.e. its time to first token; its whole time)."""
    width = max(len(p) for p, _ in batch)
    longest = max(n for _, n in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask)  # the prefill alone, for TTFT
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
        total = time.perf_counter() - t0
    return first, total


def static_batches(
    model, workload: list[tuple[list[int], int]], batch_size: int, pad_id: int, name: str
) -> RunSummary:
    """Requests in arrival order, ``batch_size`` at a time; every request of a batch waits for
    the batch before it (queueing) and for its batch's longest request."""
    clock = 0.0
    stats: list[RequestStats] = []
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        first, total = _run_batch(model, batch, pad_id)
        stats += [RequestStats(clock + first, clock + total, n) for _, n in batch]
        clock += total
        print(
            f"\r  {name}: {min(start + batch_size, len(workload))}/{len(workload)} requests",
            end="",
            flush=True,
        )
    print()
    return summarize(name, batch_size, stats, clock)


def export_hf_dir(src: ModelSource, cache_dir: Path) -> Path:
    """The model as a plain HF directory (config.json + safetensors + tokenizer), which
    ``transformers serve`` and the peers need; converted from the GGUF once and kept in the
    machine cache ``cache_dir`` (hf/NAME)."""
    dest = cache_dir / "hf" / src.name
    if (dest / "config.json").is_file():
        return dest
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvflow.services.worker.model_loader import load_weights
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import load_tokenizer

    c = load_config(src)
    cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids),
    )
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(load_weights(src, c), strict=not c.tie_word_embeddings)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    load_tokenizer(src, cache_dir).save_pretrained(str(dest))
    return dest


def start_transformers_serve(model_dir: Path, port: int) -> subprocess.Popen:
    """HF's own server with continuous batching (paged attention), on a free port."""
    exe = Path(sys.executable).parent / "transformers"
    proc = subprocess.Popen(
        [str(exe), "serve", "--continuous-batching", "--port", str(port), str(model_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_http(f"http://localhost:{port}/health", proc, "transformers serve")
    return proc
