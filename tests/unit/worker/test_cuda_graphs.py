"""The device path's host-side pieces, on the CPU: device/dtype/backend choice, the CUDA-graph
batch-size ladder and padding into static buffers, and the one-copy step metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.services.worker.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    capture_sizes,
    padded_size,
)
from kvflow.services.worker.device import kernel_backend, resolve_device, resolve_dtype
from kvflow.services.worker.step_inputs import HostStep, Staging, pack
from kvflow.shared.config import Settings

CPU = torch.device("cpu")


def rows(tables: list[list[int]]) -> np.ndarray:
    """Ragged block tables as the runner's BlockTables.rows gives them: [B, W] int32, 0-padded."""
    out = np.zeros((len(tables), max((len(t) for t in tables), default=0)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]  # max_num_seqs itself is covered
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size_is_the_next_captured_size() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 48, 64, 64,
    ]  # fmt: skip
    assert padded_size(65, sizes) is None


def test_decode_buffers_pad_rows_and_views() -> None:
    buf = DecodeBuffers(max_batch=8, max_blocks=5, device=CPU)
    # before any step every row is padding
    b8 = buf.batch(8, num_splits=3)
    assert b8.slot_mapping.tolist() == [-1] * 8 and b8.seq_lens.tolist() == [0] * 8
    tables = rows([[7, 2, 9], [4], [1, 3, 5, 6, 8]])
    buf.fill([11, 12, 13], [9, 0, 17], [37, 16, 34], [10, 1, 18], tables, padded=4)
    buf.upload(4)
    b = buf.batch(4, num_splits=3)
    assert b.input_ids.tolist() == [11, 12, 13, 0]
    assert b.positions.tolist() == [9, 0, 17, 0]
    assert b.slot_mapping.tolist() == [37, 16, 34, -1]
    assert b.seq_lens.tolist() == [10, 1, 18, 0]
    assert b.block_tables.tolist() == [
        [7, 2, 9, 0, 0], [4, 0, 0, 0, 0], [1, 3, 5, 6, 8], [0, 0, 0, 0, 0],
    ]  # fmt: skip
    assert b.query_start_loc is None and b.sample_rows is None and b.num_splits == 3
    assert all(t.dtype == torch.int32 for t in (b.input_ids, b.block_tables, b.seq_lens))
    # the views are fixed addresses in one buffer (what a captured graph reads)
    assert b.input_ids.data_ptr() == buf.device_buf.data_ptr()
    assert buf.batch(2, None).block_tables.data_ptr() == b.block_tables.data_ptr()
    # a smaller step overwrites what the rows it pads held before
    buf.fill([5], [3], [40], [4], rows([[2]]), padded=2)
    buf.upload(2)
    b = buf.batch(2, None)
    assert b.slot_mapping.tolist() == [40, -1] and b.seq_lens.tolist() == [4, 0]
    assert b.block_tables.tolist() == [[2, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    with pytest.raises(ValueError):
        buf.fill([1, 2, 3], [0] * 3, [0] * 3, [1] * 3, rows([[0]] * 3), padded=2)
    with pytest.raises(ValueError):
        buf.fill([1], [0], [0], [1], rows([[0] * 6]), padded=1)  # wider than max_blocks


def test_decode_graphs_eager_stand_in_pads_and_returns_the_real_rows() -> None:
    """Without capture, DecodeGraphs runs the padded static-buffer step eagerly: the forward
    sees the padded batch, the caller gets only its own rows."""
    seen = []

    def forward(batch):
        seen.append((batch.input_ids.tolist(), batch.slot_mapping.tolist(), batch.num_splits))
        return batch.input_ids.float()[:, None].expand(-1, 3) * torch.tensor([1.0, 2.0, 3.0])

    g = DecodeGraphs(forward, [1, 2, 4], 3, 3, CPU, lambda b: 10 + b, capture=False)
    assert g.capture() == 0.0 and not g.graphs
    out = g.run([5, 6, 7], [1, 2, 3], [8, 9, 10], [2, 3, 4], rows([[0], [1], [2]]))
    assert seen[-1] == ([5, 6, 7, 0], [8, 9, 10, -1], 14)
    assert out.tolist() == [[5, 10, 15], [6, 12, 18], [7, 14, 21]]
    assert g.fits(4, 3) and not g.fits(5, 3) and not g.fits(2, 4) and not g.fits(0, 1)
    with pytest.raises(ValueError):
        g.run([1] * 5, [0] * 5, [0] * 5, [1] * 5, rows([[0]] * 5))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(forward, [1], 1, 3, CPU, lambda b: None, capture=True)


def test_pack_mixed_and_decode_steps() -> None:
    mixed = HostStep(
        token_ids=[1, 2, 3, 4, 5, 6],
        positions=[7, 0, 1, 2, 8, 9],
        slots=[31, 4, 5, 6, 40, 41],
        block_tables=rows([[7, 3], [1], [9, 10, 11]]),
        seq_lens=[8, 3, 10],
        query_lens=[1, 3, 2],
        sample_rows=[0, 3, 5],
    )
    staging = Staging(CPU)
    b = pack(mixed, staging)
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert b.positions.tolist() == [7, 0, 1, 2, 8, 9]
    assert b.slot_mapping.tolist() == [31, 4, 5, 6, 40, 41]
    assert b.seq_lens.tolist() == [8, 3, 10]
    assert b.query_start_loc.tolist() == [0, 1, 4, 6] and b.max_query_len == 3
    assert b.sample_rows.tolist() == [0, 3, 5]
    assert b.block_tables.tolist() == [[7, 3, 0], [1, 0, 0], [9, 10, 11]]
    # one buffer: every field is a view of the same storage
    base = b.input_ids.untyped_storage().data_ptr()
    assert all(
        t.untyped_storage().data_ptr() == base
        for t in (b.positions, b.slot_mapping, b.seq_lens, b.block_tables, b.sample_rows)
    )
    d = pack(HostStep([3, 4], [5, 0], [21, 2], rows([[5, 2], [0]]), [6, 1], [1, 1], [1]), staging)
    assert d.query_start_loc is None and d.max_query_len == 1
    assert d.sample_rows.tolist() == [1] and d.block_tables.tolist() == [[5, 2], [0, 0]]
    # the host buffer is the staging's, reused: the first step's batch is not overwritten
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5, 6] and staging.allocations == 1
    big = 5000  # more than the buffer holds: it grows once, then serves smaller steps again
    wide = HostStep([1] * big, [0] * big, [0] * big, rows([[1]]), [big], [big], [big - 1])
    assert pack(wide, staging).input_ids.numel() == big and staging.allocations == 2
    first = staging.take(8).data_ptr()
    assert staging.take(16).data_ptr() == first and staging.allocations == 2


def test_device_dtype_and_backend_choice() -> None:
    assert Settings().worker.device == "auto" and Settings().model.dtype == "auto"
    assert Settings.from_env({"KVFLOW_DEVICE": "cuda"}).worker.device == "cuda"
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == CPU
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        resolve_device("tpu")
    with pytest.raises(ValueError):
        resolve_device("mps")
    cuda = torch.device("cuda")  # only a value here: nothing is allocated
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("float16", cuda) == torch.float16
    assert resolve_dtype("bf16", CPU) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int8", CPU)
    assert kernel_backend(cuda) == "triton" and kernel_backend(CPU) == "reference"
