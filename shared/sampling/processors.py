"""The host-side logits processors of the features that change logits rows (vLLM's names and
rules): logit bias, allowed tokens, penalties, bad words, min_tokens and grammars. Each works on
one row in place, so a request's logits never depend on the rest of the batch. torch is imported
only when a processor runs (the gateway imports the feature table too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.sampling.spec import LogitsProcessor, RowState

if TYPE_CHECKING:
    import torch

    from shared.messages import SamplingParams as WireParams


def apply_logit_bias(logits: torch.Tensor, row: int, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: add each value to its token's logit (in place); ids outside
    the vocabulary are ignored (the gateway rejects them)."""
    import torch

    vocab = logits.shape[-1]
    items = [(int(t), float(b)) for t, b in bias.items() if 0 <= int(t) < vocab]
    if items:
        ids = torch.tensor([t for t, _ in items])
        logits[row, ids] += torch.tensor([b for _, b in items], dtype=logits.dtype)


def allow_only_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """vLLM's ``allowed_token_ids``: every other token of ``row`` is forbidden (in place)."""
    import torch

    keep = torch.tensor([t for t in token_ids if 0 <= t < logits.shape[-1]], dtype=torch.long)
    mask = torch.ones(logits.shape[-1], dtype=torch.bool)
    mask[keep] = False
    logits[row, mask] = float("-inf")


def ban_bad_words(
    logits: torch.Tensor, row: int, words: Sequence[Sequence[int]], output: Sequence[int]
) -> None:
    """vLLM's ``bad_words``: forbid each word's last token where the output so far ends with
    the rest of the word (in place), so no banned token sequence is ever completed."""
    import torch

    vocab = logits.shape[-1]
    banned = [
        w[-1]
        for w in words
        if w
        and len(w) - 1 <= len(output)
        and (len(w) == 1 or list(output[len(output) - len(w) + 1 :]) == list(w[:-1]))
        and 0 <= w[-1] < vocab
    ]
    if banned:
        kept = logits[row, banned].clone()
        logits[row, banned] = float("-inf")
        if not torch.isfinite(logits[row]).any():  # nothing left (allowed_token_ids): undo
            logits[row, banned] = kept


def suppress_tokens(logits: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Forbid ``token_ids`` in ``row`` (in place); used to hold back EOS/stop ids before
    ``min_tokens`` outputs. Never forbids the last tokens a row has left (when
    ``allowed_token_ids`` holds only stop tokens, a stop token is the only answer)."""
    import torch

    ids = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if not ids:
        return
    kept = logits[row, ids].clone()
    logits[row, ids] = float("-inf")
    if not torch.isfinite(logits[row]).any():
        logits[row, ids] = kept


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

    x = logits[row]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long)
        if seen.numel():
            v = x[seen]
            pen = params.repetition_penalty
            x[seen] = torch.where(v > 0, v / pen, v * pen)
    if output_token_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(output_token_ids), dtype=torch.long)
        counts = torch.bincount(ids, minlength=x.shape[0])[: x.shape[0]].to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)


class LogitBias(LogitsProcessor):
    def active(self, p: WireParams) -> bool:
        return bool(p.logit_bias)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        assert st.params.logit_bias is not None
        apply_logit_bias(logits, row, st.params.logit_bias)


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

    per_step = True  # only until the row has min_tokens outputs

    def applies(self, st: RowState) -> bool:
        return st.num_output_tokens < st.params.min_tokens and st.guide is None

    def needs_host(self, st: RowState) -> bool:
        return st.num_output_tokens < st.params.min_tokens

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

    per_step = True  # the matcher's state, and whether it failed

    def applies(self, st: RowState) -> bool:
        return st.guide is not None and not st.guide.error

    def needs_host(self, st: RowState) -> bool:
        return st.guide is not None or st.guide_failed

    def apply(self, logits: torch.Tensor, states: Sequence[RowState]) -> None:
        rows = [i for i, st in enumerate(states) if self.applies(st)]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for i in rows:
            states[i].guide.matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
