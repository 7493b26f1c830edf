"""``--quantization gguf`` at load (services/worker/gguf_weights.py ``_log_kept``): the log names the
block types kept in place and, as a warning, those densified; a file with nothing to keep is
refused."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGMLQuantizationType as Q

from kvflow.services.worker.gguf_weights import _log_kept


def test_quantization_gguf_names_what_it_keeps_and_refuses_a_file_with_nothing_to_keep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Q2_K/Q3_K/IQ tensors are densified with a warning naming them; a file with no tensor a
    kernel reads in place is refused (the flag would change nothing)."""

    def t(name: str, kind: Q, dims: int = 2) -> SimpleNamespace:
        return SimpleNamespace(name=name, tensor_type=kind, shape=(64,) * dims)

    with caplog.at_level(logging.INFO, logger="kvflow.model"):
        _log_kept(
            Path("m.gguf"),
            [t("blk.0.attn_q.weight", Q.Q4_K), t("blk.0.ffn_up_exps.weight", Q.Q6_K, 3),
             t("blk.0.ffn_gate_inp.weight", Q.F32), t("blk.0.ffn_down.weight", Q.Q3_K)],
        )  # fmt: skip
    assert "kept in their blocks: Q4_K x1, Q6_K x1" in caplog.text
    assert (
        "densified to fp32 (no kvflow kernel reads these blocks in place): Q3_K x1" in caplog.text
    )
    with pytest.raises(ValueError, match="no linear weight in a block type kvflow multiplies"):
        _log_kept(Path("m.gguf"), [t("blk.0.attn_q.weight", Q.Q3_K), t("output_norm", Q.F32, 1)])
