"""Async scheduling on the worker: filling in the tokens a plan could not know.

The scheduler builds step N+1 while this worker computes step N (services/scheduler/planner.py),
so a sequence that step N samples a token for goes into N+1 with a ``PLACEHOLDER`` where that
token belongs. Plans run here in order, one after the other, so the token is the one this worker
sampled for the request in the step it ran just before. A request that step N finished (EOS, a
stop token, its length, an error) is dropped from N+1: the scheduler learns of the end only from
N's result, and computing past it would stream a token after the end.

A placeholder with no token of the step before (that step failed, or this worker did not run it:
a restart, a new scheduler term) fails the step instead of guessing: the scheduler recomputes its
sequences from what it knows.
"""

from __future__ import annotations

from kvflow.shared.messages import PLACEHOLDER, FinishReason, StepPlan, StepResult


class PlaceholderError(RuntimeError):
    """A plan names a token this worker did not sample in the step before."""


class StepTokens:
    """The tokens this worker sampled in its last step, by request, and the requests it ended."""

    def __init__(self) -> None:
        self._sampled: dict[str, list[int]] = {}
        self._ended: set[str] = set()

    def fill(self, plan: StepPlan) -> None:
        """Put the last step's tokens in place of ``plan``'s placeholders, in place, and drop
        the sequences of requests that step ended. Raises PlaceholderError for a placeholder
        with no such token."""
        seqs = []
        sampled, ended = self._sampled, self._ended
        for s in plan.seqs:
            t = s.token_ids
            if len(t) == 1 and t[0] == PLACEHOLDER and not s.num_draft:  # most decode steps
                got = sampled.get(s.request_id)
                if got is not None and s.request_id not in ended:
                    t[0] = got[-1]
                    seqs.append(s)
                    continue
            num = _trailing_placeholders(t, s.num_draft)
            if not num:
                seqs.append(s)
                continue
            if s.request_id in self._ended:
                continue
            got = self._sampled.get(s.request_id, [])
            if len(got) < num:
                raise PlaceholderError(
                    f"step {plan.step_id}: request {s.request_id} has {num} token(s) of the "
                    f"step before to fill in, and this worker sampled {len(got)} for it there"
                )
            at = len(s.token_ids) - s.num_draft - num
            s.token_ids[at : at + num] = got[len(got) - num :]
            seqs.append(s)
        plan.seqs = seqs

    def record(self, result: StepResult) -> None:
        """Keep what ``result``'s step sampled (only that step's: a placeholder never refers
        further back); a failed step leaves nothing to fill in."""
        self._sampled, self._ended = sampled, ended = {}, set()
        if result.error:
            return
        for rid, tok, reason in zip(
            result.request_ids, result.token_ids, result.finish_reasons, strict=True
        ):
            got = sampled.get(rid)
            if got is None:
                sampled[rid] = [tok]
            else:  # a chunk with drafts: several tokens
                got.append(tok)
            if reason != FinishReason.NONE:
                ended.add(rid)

    def clear(self) -> None:
        """Forget everything (a new scheduler term: its plans start from known tokens)."""
        self._sampled, self._ended = {}, set()


def _trailing_placeholders(token_ids: list[int], num_draft: int) -> int:
    """How many placeholders end a chunk's known tokens (before its drafts)."""
    n, i = 0, len(token_ids) - num_draft - 1
    while i >= 0 and token_ids[i] == PLACEHOLDER:
        n += 1
        i -= 1
    return n
