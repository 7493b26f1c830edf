"""Prompt logprobs (echo with logprobs, vLLM's ``prompt_logprobs``): the log-probability of every
prompt token given the ones before it, its rank, and the top-k alternatives.

Only requests that ask pay for it: their prompt rows are added to the rows the model computes
logits for (the lm_head runs on sampled rows otherwise). Row ``p`` predicts the token at
``p + 1``; the last row of a prompt chunk that is not the prompt's last chunk predicts the first
token of the *next* chunk, so its log-softmax waits in the request's state until that chunk
arrives. The row at ``prompt_len - 1`` predicts the first output token (the sampled row), so it
is not a prompt row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvflow.shared.messages import PromptLogprobs, ScheduledSeq

ROWS_PER_BLOCK = 256  # log-softmax this many rows at a time (a row is vocab_size floats)


class PromptState(Protocol):
    """What the runner keeps per request for this (see RequestState)."""

    prompt_len: int
    prompt_logprobs_k: int | None  # top alternatives wanted; None: not asked (or already sent)
    pending_prompt_row: tuple[int, torch.Tensor] | None  # (position it predicts, log-softmax)


@dataclass
class _Piece:
    request_id: str
    state: PromptState
    first_row: int  # index into this step's extra logits rows
    start: int  # chunk start position
    num_rows: int  # rows start .. start + num_rows - 1
    token_ids: list[int]  # the chunk's tokens


@dataclass
class PromptRows:
    """One step's prompt rows: ``add`` each scheduled chunk, give ``rows`` to the model, then
    ``collect`` the logits it returned for them."""

    rows: list[int] = field(default_factory=list)  # indices into the step's flat token rows
    _pieces: list[_Piece] = field(default_factory=list)

    def add(self, seq: ScheduledSeq, st: PromptState, start_row: int) -> None:
        if st.prompt_logprobs_k is None:
            return
        start, end = seq.start_pos, seq.start_pos + len(seq.token_ids)
        last = min(end, st.prompt_len - 1)  # rows start..last-1 predict prompt tokens
        n = max(0, last - start)
        pending = st.pending_prompt_row
        if n == 0 and (pending is None or pending[0] != start):
            return
        self._pieces.append(
            _Piece(seq.request_id, st, len(self.rows), start, n, list(seq.token_ids))
        )
        self.rows += range(start_row, start_row + n)

    def collect(self, logits: torch.Tensor) -> list[PromptLogprobs]:
        """Logprobs for the pieces added, from ``logits`` [len(rows), V] (their rows in order)."""
        out = []
        for piece in self._pieces:
            rows = logits[piece.first_row : piece.first_row + piece.num_rows]
            got = _piece_logprobs(piece, rows)
            if got.token_ids:
                out.append(got)
        return out


def _piece_logprobs(piece: _Piece, logits: torch.Tensor) -> PromptLogprobs:
    st, k = piece.state, int(piece.state.prompt_logprobs_k or 0)
    rows: list[torch.Tensor] = []  # log-softmax rows, each predicting the next position
    targets: list[int] = []
    first_pos = piece.start + 1
    pending = st.pending_prompt_row
    if pending is not None and pending[0] == piece.start:
        rows.append(pending[1][None, :])
        targets.append(piece.token_ids[0])
        first_pos = piece.start
    st.pending_prompt_row = None
    chunk_end = piece.start + len(piece.token_ids)
    for b in range(0, piece.num_rows, ROWS_PER_BLOCK):
        lsm = torch.log_softmax(logits[b : b + ROWS_PER_BLOCK].float(), dim=-1)
        for r in range(lsm.shape[0]):
            target_pos = piece.start + b + r + 1
            if target_pos < chunk_end:
                rows.append(lsm[r : r + 1])
                targets.append(piece.token_ids[target_pos - piece.start])
            else:  # predicts the next chunk's first token: keep it until that chunk runs
                st.pending_prompt_row = (target_pos, lsm[r].clone())
    if not rows:
        return PromptLogprobs(piece.request_id, first_pos, [], [], [])
    lsm = torch.cat(rows)
    tgt = torch.tensor(targets).to(lsm.device)
    lps = lsm.gather(1, tgt[:, None])[:, 0]
    ranks = (lsm > lps[:, None]).sum(dim=1) + 1
    top_v, top_i = lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0].long())
    return PromptLogprobs(
        request_id=piece.request_id,
        start=first_pos,
        token_ids=targets,
        logprobs=lps.tolist(),
        ranks=ranks.tolist(),
        top_ids=top_i.tolist() if k else [],
        top_logprobs=top_v.tolist() if k else [],
    )
