"""A GGUF file's header read without its big arrays: the metadata a config needs and the tensor
table, in a fraction of a second.

gguf-py's ``GGUFReader`` builds every metadata array as numpy views part by part, which for a
262k-entry vocabulary (Gemma 3) takes 15-18 s on 2 cores; the early config check of ``kvflow
serve`` / ``LLM()`` and every service that reads the config would each pay it. Here numeric
arrays are read with one ``numpy.frombuffer`` each and string arrays are skipped (their lengths
walked) unless asked for. The weights are read from the same table (``tensors``): each tensor's
bytes mapped from the file, shaped as ``GGUFReader`` shapes them (services/worker/gguf_weights.py).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2 and v3).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    type: int  # GGMLQuantizationType value
    offset: int  # from the start of the data section


@dataclass
class GGUFHeader:
    path: Path
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    strings: dict[str, list[str]] = field(default_factory=dict)  # string arrays kept
    version: int = 3
    # where each metadata entry (key, type and value) and the tensor table lie in the file:
    # (start, end) byte offsets, for tools that copy a file with some entries changed
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    table_span: tuple[int, int] = (0, 0)

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry spelled ``text`` (None without one)."""
        tokens = self.strings.get("tokenizer.ggml.tokens", [])
        try:
            return tokens.index(text)
        except ValueError:
            return None

    def f32_tensor(self, name: str) -> np.ndarray:
        """A small F32 tensor's values (e.g. ``rope_freqs.weight``)."""
        info = self.tensors[name]
        if info.type != 0:
            raise ValueError(f"{name} is not an F32 tensor")
        count = int(np.prod(info.shape))
        with self.path.open("rb") as f:
            f.seek(self.data_offset + info.offset)
            return np.frombuffer(f.read(4 * count), dtype="<f4").copy()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as gguf-py's ``ReaderTensor`` gives it: ``data`` is a read-only
    view of the mapped file, numpy-shaped (slowest dimension first), in the type's element
    type for F32/F16/F64 and integer types, else (block types, BF16) ``uint8`` with one row of
    bytes per row of the tensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    data: np.ndarray


def read_tensors(header: GGUFHeader) -> list[GGUFTensor]:
    """Every tensor of ``header``'s file in table order, each a view of one read-only map of the
    file (kept alive by the views)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    plain = {0: "<f4", 1: "<f2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}
    mm = np.memmap(header.path, dtype=np.uint8, mode="r")
    out = []
    for name, info in header.tensors.items():
        qtype = GGMLQuantizationType(info.type)
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(info.shape))
        start = header.data_offset + info.offset
        raw = mm[start : start + count // block * size]
        dims = tuple(reversed(info.shape))
        if info.type in plain:
            data = raw.view(plain[info.type]).reshape(dims)
        else:  # block types, and BF16 (as GGUFReader gives it: its bytes)
            data = raw.reshape(*dims[:-1], dims[-1] // block * size)
        out.append(GGUFTensor(name, qtype, info.shape, data))
    return out


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.at += n
        return bytes(self.buf[self.at - n : self.at]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]

    def value(self, kind: int, key: str, keep: frozenset[str], out: GGUFHeader) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} for {key}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == _STRING:
            if key in keep:
                out.strings[key] = [self.string() for _ in range(count)]
            else:
                self.skip_strings(count)
            return None
        if item not in _NUMPY:
            raise ValueError(f"unsupported GGUF array type {item} for {key}")
        dt = np.dtype(_NUMPY[item])
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.at)
        self.at += count * dt.itemsize
        return arr.tolist() if count <= 4096 else None  # big numeric arrays: not config


def read_header(path: Path, keep_strings: frozenset[str] = frozenset()) -> GGUFHeader:
    """The metadata (small values) and the tensor table of the GGUF at ``path``; string arrays
    named in ``keep_strings`` are kept in ``GGUFHeader.strings``."""
    out = GGUFHeader(Path(path))
    with Path(path).open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        c = _Cursor(memoryview(mm))
        try:
            if bytes(c.buf[:4]) != b"GGUF":
                raise ValueError(f"{path.name} is not a GGUF file")
            c.at = 4
            version = out.version = c.unpack("<I")
            if version < 2:
                raise ValueError(f"{path.name}: GGUF version {version} is not supported")
            n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
            for _ in range(n_kv):
                start = c.at
                key = c.string()
                value = c.value(c.unpack("<I"), key, keep_strings, out)
                if value is not None:
                    out.fields[key] = value
                out.spans[key] = (start, c.at)
            start = c.at
            for _ in range(n_tensors):
                name = c.string()
                dims = c.unpack("<I")
                shape = tuple(c.unpack("<Q") for _ in range(dims))
                out.tensors[name] = TensorInfo(shape, c.unpack("<I"), c.unpack("<Q"))
            out.table_span = (start, c.at)
            align = int(out.fields.get("general.alignment", _ALIGNMENT))
            out.data_offset = -(-c.at // align) * align
        finally:
            c.buf.release()
    return out
