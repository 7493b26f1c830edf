"""A GGUF file for transformers' GGUF loader without the vocabulary arrays, so that a test's
reference model loads in seconds rather than a minute.

transformers parses a GGUF's metadata with gguf-py's ``GGUFReader`` twice (config, then
weights), which builds every string of the vocabulary as numpy views: 15-18 s per parse for
Gemma 3's 262,144 tokens on 2 cores. The model needs none of it but the vocabulary's size,
which the copy states as ``ARCH.vocab_size`` (what transformers would count from the tokens).
Everything else (every other key, the tensor table, every tensor byte) is copied unchanged;
the tests tokenize with kvflow's tokenizer on the original file."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

DROPPED = {f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges")}
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Walk:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> int:
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.at += n
        return self.buf[self.at - n : self.at].decode("utf-8", errors="replace")

    def value(self, kind: int) -> int | None:
        """Skips a value; returns an array's length (None for a scalar or a string)."""
        if kind in _SIZES:
            self.at += _SIZES[kind]
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            for _ in range(count):
                self.value(item)
            return count
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
        return None


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def without_vocabulary(src: Path, dst: Path) -> Path:
    """``dst``: ``src`` without the vocabulary arrays, its size as ``ARCH.vocab_size`` (made
    once; a later call with the same ``src`` size and time returns the file)."""
    stamp = dst.with_suffix(".source")
    mark = f"{src.stat().st_size} {src.stat().st_mtime_ns}"
    if dst.exists() and stamp.exists() and stamp.read_text() == mark:
        return dst
    with src.open("rb") as f:
        head = f.read(64 << 20)  # the metadata and the tensor table lie in the first MiB's
    w = _Walk(head)
    assert head[:4] == b"GGUF", f"{src} is not a GGUF file"
    w.at = 4
    version, n_tensors, n_kv = w.take("<I"), w.take("<Q"), w.take("<Q")
    kept, arch, vocab, keys, alignment = [], "llama", 0, set(), 32
    for _ in range(n_kv):
        start = w.at
        key = w.string()
        kind = w.take("<I")
        value_at = w.at
        count = w.value(kind)
        keys.add(key)
        if key == "general.architecture":
            arch = _Walk(head[value_at:]).string()
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", head, value_at)[0]
        if key == "tokenizer.ggml.tokens":
            vocab = count or 0
        if key not in DROPPED:
            kept.append(head[start : w.at])
    if f"{arch}.vocab_size" not in keys:
        kept.append(_string(f"{arch}.vocab_size") + struct.pack("<II", _UINT32, vocab))
    infos_start = w.at
    for _ in range(n_tensors):
        w.string()
        dims = w.take("<I")
        w.at += 8 * dims + 4 + 8
    infos = head[infos_start : w.at]
    data_offset = -(-w.at // alignment) * alignment

    out = struct.pack("<4sIQQ", b"GGUF", version, n_tensors, len(kept)) + b"".join(kept) + infos
    out += b"\0" * (-len(out) % alignment)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    with src.open("rb") as f, tmp.open("wb") as g:
        g.write(out)
        f.seek(data_offset)
        shutil.copyfileobj(f, g, 16 << 20)
    tmp.replace(dst)
    stamp.write_text(mark)
    return dst


CACHE = Path.home() / ".cache" / "kvflow-tests" / "gguf-without-vocabulary"


def transformers_model(path: Path, dtype: object) -> object:
    """transformers' model of the GGUF at ``path`` (its GGUF loader, dequantizing every tensor
    as it does), read from the copy without the vocabulary."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    copy = without_vocabulary(Path(path), CACHE / Path(path).name)
    return AutoModelForCausalLM.from_pretrained(
        str(copy.parent), gguf_file=copy.name, dtype=dtype
    ).eval()
