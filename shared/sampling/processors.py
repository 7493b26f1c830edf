"""The logits processors of the features that change logits rows (vLLM's names and
rules): logit bias, allowed tokens, penalties, bad words, min_tokens and grammars. Each works on
one row in place, so a request's logits never depend on the rest of the batch, and on the
logits' device (the GPU on the device path) without reading a value back: what a processor
decides from the token history is decided on the host, where the history is. torch is imported
only when a processor runs (the gateway imports the feature table too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.shared.sampling.spec import LogitsProcessor, RowState

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvflow.shared.messages import SamplingParams as WireParams


def _on(logits: torch.Tensor, values: Sequence, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on the logits' device (one copy, no read back)."""
    import torch

    t = torch.tensor(list(values), dtype=dtype if dtype is not None else torch.long)
    return t.to(logits.device, non_blocking=True)


def _forbid_unless_nothing_left(logits: torch.Tensor, row: int, ids: Sequence[int]) -> None:
    """Set ``ids`` of ``row`` to -inf, unless that would leave the row with no finite logit
    (then the row stays as it was). Decided on the device: no value is read back."""
    import torch

    x = logits[row]
    banned = x.index_fill(0, _on(logits, ids), float("-inf"))
    logits[row] = torch.where(torch.isfinite(banned).any(), banned, x)


def apply_logit_bias(logits: torch.Tensor, row: int, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: add each value to its token's logit (in place); ids outside
    the vocabulary are ignored (the gateway rejects them)."""
    vocab = logits.shape[-1]
    items = [(int(t), float(b)) for t, b in bias.items() if 0 <= int(t) < vocab]
    if items:
        ids = _on(logits, [t for t, _ in items])
        logits[row].index_add_(0, ids, _on(logits, [b for _, b in items], logits.dtype))


def allow_only_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """vLLM's ``allowed_token_ids``: every other token of ``row`` is forbidden (in place)."""
    import torch

    keep = _on(logits, [t for t in token_ids if 0 <= t < logits.shape[-1]])
    mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[keep] = False
    logits[row].masked_fill_(mask, float("-inf"))


def ban_bad_words(
    logits: torch.Tensor, row: int, words: Sequence[Sequence[int]], output: Sequence[int]
) -> None:
    """vLLM's ``bad_words``: forbid each word's last token where the output so far ends with
    the rest of the word (in place), so no banned token sequence is ever completed."""
    vocab = logits.shape[-1]
    banned = [
        w[-1]
        for w in words
        if w
        and len(w) - 1 <= len(output)
        and (len(w) == 1 or list(output[len(output) - len(w) + 1 :]) == list(w[:-1]))
        and 0 <= w[-1] < vocab
    ]
    if banned:  # nothing left (allowed_token_ids): the row stays as it was
        _forbid_unless_nothing_left(logits, row, banned)


def suppress_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Forbid ``token_ids`` in ``row`` (in place); used to hold back EOS/stop ids before
    ``min_tokens`` outputs. Never forbids the last tokens a row has left (when
    ``allowed_token_ids`` holds only stop tokens, a stop token is the only answer)."""
    ids = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if ids:
        _forbid_unless_nothing_left(logits, row, ids)


def apply_penalties(
    logits: torch.Tensor,
    row: int,
    params: WireParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> None:
    """vLLM's repetition (prompt + output tokens), presence and frequency (output tokens)
    penalties, in place on one row."""
    import torch

    x, vocab = logits[row], logits.shape[-1]
    output_token_ids = [t for t in output_token_ids if 0 <= t < vocab]
    if params.repetition_penalty != 1.0:
        seen = sorted(t for t in set(prompt_token_ids) | set(output_token_ids) if 0 <= t < vocab)
        if seen:
            ids = _on(logits, seen)
            v = x[ids]
            pen = params.repetition_penalty
            x[ids] = torch.where(v > 0, v / pen, v * pen)
    if output_token_ids and (params.presence_penalty or params.frequency_penalty):
        ids = _on(logits, output_token_ids)
        counts = torch.zeros_like(x).index_add_(0, ids, torch.ones_like(ids, dtype=x.dtype))
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)


class LogitBias(LogitsProcessor):
    def active(self, p: WireParams) -> bool:
        return bool(p.logit_bias)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        assert st.params.logit_bias is not None
        apply_logit_bias(logits, row, st.params.logit_bias)

    def apply(self, logits: torch.Tensor, states: Sequence[RowState]) -> None:
        """Every row's bias in one ``index_add_`` over the flat logits (two copies to the
        device for the batch, not two per row): the same values as ``apply_logit_bias``."""
        if not logits.is_contiguous():
            super().apply(logits, states)
            return
        vocab = logits.shape[-1]
        at: list[int] = []
        by: list[float] = []
        for r, st in enumerate(states):
            if self.applies(st):
                for t, b in (st.params.logit_bias or {}).items():
                    if 0 <= int(t) < vocab:
                        at.append(r * vocab + int(t))
                        by.append(float(b))
        if at:
            logits.view(-1).index_add_(0, _on(logits, at), _on(logits, by, logits.dtype))


class AllowedTokens(LogitsProcessor):
    def active(self, p: WireParams) -> bool:
        return bool(p.allowed_token_ids)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        allow_only_tokens(logits, row, st.params.allowed_token_ids or [])


class Penalties(LogitsProcessor):
    needs_history = True

    def active(self, p: WireParams) -> bool:
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        apply_penalties(logits, row, st.params, st.prompt_tokens, st.output_tokens)

    def apply(self, logits: torch.Tensor, states: Sequence[RowState]) -> None:
        """Every row at once, touching only the penalised entries (a few tensor ops for the
        batch, not a few per row): the same values as ``apply_penalties`` row by row. What each
        request's tokens give is kept between its steps (``TokenHistory``, on the state's
        ``history_memo``): a step reads only the outputs since the last, not the prompt again."""
        import numpy as np
        import torch

        if not logits.is_contiguous():  # the flat indices below need one row after another
            super().apply(logits, states)
            return
        vocab = logits.shape[-1]
        seen: list[np.ndarray] = []  # per row: distinct prompt or output tokens (repetition)
        seen_at: list[tuple[int, float]] = []  # (row's offset, penalty)
        said: list[np.ndarray] = []  # per row: distinct output tokens (presence, frequency)
        said_n: list[np.ndarray] = []  # how many times each
        said_at: list[tuple[int, float, float]] = []  # (row's offset, frequency, presence)
        for r, st in enumerate(states):
            if not self.applies(st):
                continue
            h = TokenHistory.of(st, vocab)
            p, base = st.params, r * vocab
            if p.repetition_penalty != 1.0 and len(h.seen):
                seen.append(h.seen.view())
                seen_at.append((base, float(p.repetition_penalty)))
            if len(h.said) and (p.presence_penalty or p.frequency_penalty):
                said.append(h.said.view())
                said_n.append(h.counts.view())
                said_at.append((base, float(p.frequency_penalty), float(p.presence_penalty)))
        flat, dtype = logits.view(-1), logits.dtype

        def on(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(logits.device, non_blocking=True)

        def spread(parts: list[np.ndarray], values: list) -> list[np.ndarray]:
            """Each row's values repeated over its entries (offsets int64, penalties float64)."""
            lens = [len(a) for a in parts]
            return [np.repeat(np.asarray(v), lens) for v in zip(*values, strict=True)]

        if seen:
            base, pen = spread(seen, seen_at)
            at = on(np.concatenate(seen) + base)
            pen_t = on(pen).to(dtype)
            v = flat[at]
            flat[at] = torch.where(v > 0, v / pen_t, v * pen_t)
        if said:
            base, f, q = spread(said, said_at)
            at = on(np.concatenate(said) + base)
            n = on(np.concatenate(said_n)).to(dtype)
            f_t, q_t = on(f).to(dtype), on(q).to(dtype)
            flat[at] = flat[at] - (f_t * n + q_t * (n > 0).to(dtype))


class _Grown:
    """An int64 numpy array appended to in place (capacity doubled when full)."""

    def __init__(self, values: Sequence[int] = ()) -> None:
        import numpy as np

        self._buf = np.zeros(max(16, 2 * len(values)), np.int64)
        self._buf[: len(values)] = values
        self._n = len(values)

    def __len__(self) -> int:
        return self._n

    def append(self, value: int) -> None:
        import numpy as np

        if self._n == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
        self._buf[self._n] = value
        self._n += 1

    def add(self, i: int, value: int) -> None:
        self._buf[i] += value

    def view(self) -> np.ndarray:
        return self._buf[: self._n]


class TokenHistory:
    """What the penalties read of one request's tokens, kept between its steps (the state's
    ``history_memo``): the distinct prompt and output tokens (repetition), and the distinct
    output tokens with their counts (presence, frequency), all inside the vocabulary. The
    prompt is read once; each step folds in only the outputs since the last (outputs only
    grow; a state whose outputs shrank or whose vocabulary differs is read again whole)."""

    def __init__(self, prompt: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        distinct = sorted({t for t in prompt if 0 <= t < vocab})
        self._seen_set = set(distinct)
        self.seen = _Grown(distinct)
        self._said_index: dict[int, int] = {}
        self.said = _Grown()
        self.counts = _Grown()
        self.folded = 0  # outputs read so far

    @classmethod
    def of(cls, st: RowState, vocab: int) -> TokenHistory:
        h = getattr(st, "history_memo", None)
        if not isinstance(h, cls) or h.vocab != vocab or h.folded > len(st.output_tokens):
            h = cls(st.prompt_tokens, vocab)
            st.history_memo = h
        h.fold(st.output_tokens)
        return h

    def fold(self, output: Sequence[int]) -> None:
        for i in range(self.folded, len(output)):
            t = output[i]
            if not 0 <= t < self.vocab:
                continue
            if t not in self._seen_set:
                self._seen_set.add(t)
                self.seen.append(t)
            j = self._said_index.get(t)
            if j is None:
                self._said_index[t] = len(self.said)
                self.said.append(t)
                self.counts.append(1)
            else:
                self.counts.add(j, 1)
        self.folded = len(output)


class BadWords(LogitsProcessor):
    needs_history = True

    def active(self, p: WireParams) -> bool:
        return bool(p.bad_words_token_ids)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        ban_bad_words(logits, row, st.params.bad_words_token_ids, st.output_tokens)


class MinTokens(LogitsProcessor):
    """Hold back EOS and stop ids until ``min_tokens`` are out; under a grammar, the grammar
    decides where the output may end."""

    def active(self, p: WireParams) -> bool:
        return p.min_tokens > 0

    def applies(self, st: RowState) -> bool:
        return st.num_output_tokens < st.params.min_tokens and st.guide is None

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        stops = set(st.stop_token_ids)
        if not st.params.ignore_eos:
            stops |= st.eos_token_ids
        suppress_tokens(logits, row, sorted(stops))


class Grammar(LogitsProcessor):
    """Structured output: mask the tokens each row's grammar matcher does not allow next, in one
    batched xgrammar call. A constraint that failed to compile ends its request on the host."""

    def active(self, p: WireParams) -> bool:
        return p.structured_output is not None

    def applies(self, st: RowState) -> bool:
        return st.guide is not None and not st.guide.error

    def apply(self, logits: torch.Tensor, states: Sequence[RowState]) -> None:
        rows = [i for i, st in enumerate(states) if self.applies(st)]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for i in rows:
            states[i].guide.matcher.fill_next_token_bitmask(bitmask, i)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
