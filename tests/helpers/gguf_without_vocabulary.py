"""A GGUF file for transformers' GGUF loader without the vocabulary arrays, so that a test's
reference model loads in seconds rather than a minute.

transformers parses a GGUF's metadata with gguf-py's ``GGUFReader`` twice (config, then
weights), which builds every string of the vocabulary as numpy views: 15-18 s per parse for
Gemma 3's 262,144 tokens on 2 cores. The model needs none of it but the vocabulary's size,
which the copy states as ``ARCH.vocab_size`` (what transformers would count from the tokens).
Everything else (every other entry, the tensor table, every tensor byte) is copied unchanged;
the tests tokenize with kvflow's tokenizer on the original file.

What transformers' loader makes of the copy is saved once as safetensors beside it and read
from there later (the same tensors, config and generation config): the loader itself takes
10-60 s more per load, most of it rebuilding gguf-py's tensor-name map for each tensor."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

from kvflow.shared.gguf_header import read_header

DROPPED = {f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges")}
CACHE = Path.home() / ".cache" / "kvflow-tests" / "gguf-without-vocabulary"
_UINT32 = 4


def _entry(key: str, value: int) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<II", _UINT32, value)


def without_vocabulary(src: Path, dst: Path) -> Path:
    """``dst``: ``src`` without the vocabulary arrays, its size as ``ARCH.vocab_size`` (made
    once; a later call with the same ``src`` size and time returns the file)."""
    stamp = dst.with_suffix(".source")
    mark = f"{src.stat().st_size} {src.stat().st_mtime_ns}"
    if dst.exists() and stamp.exists() and stamp.read_text() == mark:
        return dst
    header = read_header(src, keep_strings=frozenset({"tokenizer.ggml.tokens"}))
    arch = header.fields.get("general.architecture", "llama")
    alignment = int(header.fields.get("general.alignment", 32))
    with src.open("rb") as f:
        head = f.read(header.table_span[1])
    kept = [head[a:b] for key, (a, b) in header.spans.items() if key not in DROPPED]
    if f"{arch}.vocab_size" not in header.spans:
        kept.append(_entry(f"{arch}.vocab_size", len(header.strings["tokenizer.ggml.tokens"])))
    out = struct.pack("<4sIQQ", b"GGUF", header.version, len(header.tensors), len(kept))
    out += b"".join(kept) + head[slice(*header.table_span)]
    out += b"\0" * (-len(out) % alignment)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(f".{os.getpid()}.partial")  # test processes may make it together
    with src.open("rb") as f, tmp.open("wb") as g:
        g.write(out)
        f.seek(header.data_offset)
        shutil.copyfileobj(f, g, 16 << 20)
    tmp.replace(dst)
    stamp.write_text(mark)
    return dst


def transformers_model(path: Path, dtype: object) -> object:
    """transformers' model of the GGUF at ``path`` (its GGUF loader, dequantizing every tensor
    as it does), read from the copy without the vocabulary; saved as safetensors the first time
    (a later call with the same file's size and time, ``dtype`` and transformers and torch
    versions reads that)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    src = Path(path)
    saved = CACHE / f"{src.name}.{str(dtype).removeprefix('torch.')}"
    mark = f"{src.stat().st_size} {src.stat().st_mtime_ns}"
    mark += f" transformers {transformers.__version__} torch {torch.__version__}"
    if _stamped(saved, mark):
        return AutoModelForCausalLM.from_pretrained(str(saved), dtype=dtype).eval()
    copy = without_vocabulary(src, CACHE / src.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(copy.parent), gguf_file=copy.name, dtype=dtype
    ).eval()
    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.partial")  # test processes may save together
    # the tensors are dequantized already: only the loader's GGUF quantizer, which
    # save_pretrained refuses, says otherwise
    quantizer, model.hf_quantizer = model.hf_quantizer, None
    try:
        model.save_pretrained(str(tmp))
    finally:
        model.hf_quantizer = quantizer
    (tmp / "source").write_text(mark)
    if _stamped(saved, mark):  # another process saved it meanwhile
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(saved, ignore_errors=True)  # another file's, or another version's
        tmp.rename(saved)
    return model


def _stamped(saved: Path, mark: str) -> bool:
    return (saved / "source").exists() and (saved / "source").read_text() == mark
