"""Pooling requests (vLLM's pooling tasks ``embed``, ``classify``, ``score``): a request with
``NewRequest.pooling`` computes its prompt like any prefill, but instead of sampling it pools the
final hidden states (the model's last norm output, what HF ``LlamaModel`` or ``BertModel``
returns as ``last_hidden_state``) into one vector: the embedding, or what a classification head
makes of it (``finish``).

Chunked prefill: each chunk contributes the rows the pooling type reads (``rows_of``); MEAN keeps
a running fp32 sum and count across chunks, CLS keeps row 0 from the chunk that starts the
prompt, LAST takes the last row of the chunk that completes the prompt. When that chunk has run
(``ScheduledSeq.sample``), the vector is finished (``finish``: mean, then L2 norm when asked) and
sent as little-endian float32 bytes in ``StepResult.embeddings``. A request recomputed after a
preemption or a migration arrives again as a NewRequest, so its state starts over.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.shared.messages import PooledOutput, PoolingParams, ScheduledSeq


@dataclass
class PoolState:
    """What an embedding request accumulates across its prompt's chunks."""

    pooling: PoolingParams
    prompt_len: int
    total: torch.Tensor | None = None  # MEAN: sum of the rows so far (fp32); CLS: row 0
    count: int = 0  # rows summed (MEAN)

    def rows_of(self, s: ScheduledSeq) -> range:
        """The chunk's rows (offsets within it) this request needs from ``s``."""
        n, kind = len(s.token_ids), self.pooling.pooling_type
        if kind == "MEAN":
            return range(n)
        if kind == "CLS":
            return range(1) if s.start_pos == 0 else range(0)
        return range(n - 1, n) if s.start_pos + n == self.prompt_len else range(0)  # LAST

    def add(self, hidden: torch.Tensor) -> None:
        """Take this chunk's rows (``rows_of``'s, in order) of final hidden states."""
        if hidden.shape[0] == 0:
            return
        h = hidden.float()
        if self.pooling.pooling_type == "MEAN":
            part = h.sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.count += h.shape[0]
        else:  # LAST and CLS: their one row
            self.total = h[-1].clone()
            self.count = 1

    def finish(
        self,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        score_activation: str = "sigmoid",
    ) -> torch.Tensor:
        """The request's output (fp32): ``embed``, the pooled vector (L2-normalized when
        asked); ``classify``, the class probabilities of ``head``'s logits (softmax; a sigmoid
        for one class); ``score``, the one logit through ``score_activation``."""
        if self.total is None or self.count == 0:
            raise RuntimeError("no rows were pooled (the prompt was not computed here)")
        v = self.total / self.count
        task = self.pooling.task
        if task == "embed":
            if self.pooling.normalize:
                v = torch.nn.functional.normalize(v, p=2.0, dim=0)
            return v
        if head is None:
            raise ValueError(f"task {task!r} needs a model with a classification head")
        logits = head(v).float()
        if task == "classify" and logits.numel() > 1:
            return torch.softmax(logits, dim=0)
        return logits if score_activation == "identity" else torch.sigmoid(logits)


def pooled_output(request_id: str, vector: torch.Tensor) -> PooledOutput:
    """The wire form: little-endian float32 bytes, OpenAI's base64 layout."""
    v = vector.detach().to(torch.float32).contiguous().cpu()
    data = v.numpy().tobytes()
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        data = v.numpy().byteswap().tobytes()
    return PooledOutput(request_id, data, v.numel())
