"""Speculative decoding, the scheduler's half: n-gram (prompt lookup) draft tokens proposed
where every sequence's tokens already are, how many to propose, and the acceptance counters.

A decoding sequence's next step computes its last token plus up to ``num_speculative_tokens``
drafts: the tokens that followed the latest earlier occurrence of its last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, longest match first). The worker verifies
them in the same forward pass (services/worker/speculation.py) and returns every accepted
token plus the one its model chose after them, so a step yields 1 to k + 1 tokens.

Drafts cost compute (one row each) whether accepted or not, so each sequence adapts: after a
step that accepted nothing it stops proposing for 1, 2, 4, ... steps (up to 64), and after a
partial acceptance it proposes one more than were accepted. Free-form text, where lookups
rarely match or match wrongly, thus pays for a handful of rows; quoting or editing a given
text runs at full depth.

Proposing changes nothing (the planner is a pure function of the scheduler's state): a
``Proposal`` says what the step would spend, and WorkerState applies it when it applies the
plan (``Speculator.proposed``), as it applies a verification's outcome (``verified``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvflow.services.scheduler.sequence import Sequence
from kvflow.services.scheduler.spec_state import NgramIndex, SpecState
from kvflow.shared.speculative import SpeculativeConfig, can_speculate

MAX_COOLDOWN = 64  # steps without proposals after repeated misses, at most


class Drafts(NamedTuple):
    """A step's drafts for one sequence: the scheduler's own (n-gram ``tokens``), or a number
    the worker's draft model proposes (``num_worker``)."""

    tokens: list[int]
    num_worker: int = 0

    @property
    def count(self) -> int:
        return len(self.tokens) + self.num_worker


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: drafts (verification steps with at least one draft), draft
    tokens, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Proposal(NamedTuple):
    """What the proposer says of one sequence's next step: its drafts (None: it decodes one
    token), its proposer state (a new one when the sequence had none yet: the sequence keeps
    it from then on) and whether the step spends one of its cooldown steps."""

    drafts: Drafts | None
    state: SpecState
    cooling: bool = False


class Speculator:
    """Proposes drafts for sequences and learns from what their verification accepted; the one
    writer of every ``SpecState`` and of the counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, seq: Sequence, budget: int, max_model_len: int, batch_size: int) -> Proposal:
        """Drafts for ``seq`` (whose next step computes only its last token) within
        ``budget`` tokens, its max_tokens and ``max_model_len``; ``drafts`` None when it should
        decode one token. Runs for every decoding sequence every step: cheapest checks first.
        Changes nothing but the index's memo (``proposed`` applies the rest)."""
        st = seq.spec
        cfg = self.config
        if st is None:  # what the parameters allow is decided once (min_tokens aside)
            index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            eligible = seq.pooling is None and can_speculate(seq.params, seq.params.min_tokens)
            st = SpecState(index, cfg.num_speculative_tokens, eligible=eligible)
        if not st.eligible or seq.reservation is not None:
            return Proposal(None, st)
        if st.cooldown > 0:
            return Proposal(None, st, cooling=True)
        if cfg.disable_by_batch_size and batch_size >= cfg.disable_by_batch_size:
            return Proposal(None, st)
        p, tokens = seq.params, seq.token_ids
        num_out = len(tokens) - seq.prompt_len
        if num_out < p.min_tokens:
            return Proposal(None, st)
        n = min(budget, p.max_tokens - num_out - 1, max_model_len - len(tokens) - 1, st.depth)
        if n <= 0:
            return Proposal(None, st)
        if cfg.proposed_by_worker:
            return Proposal(Drafts([], n), st)
        drafts = st.index.propose(tokens, n)
        return Proposal(Drafts(drafts) if drafts else None, st)

    def proposed(self, proposal: Proposal) -> None:
        """A plan was built with ``proposal``: a step of its cooldown is spent."""
        if proposal.cooling:
            proposal.state.cooldown -= 1

    def verified(self, seq: Sequence, drafts: Drafts, emitted: list[int]) -> int:
        """Record a verification: ``emitted`` are the tokens the step returned for ``seq``
        (accepted drafts, then the model's own token unless the sequence ended on a draft).
        Returns how many drafts were accepted (the worker's own drafts are not sent back: a
        sequence that ended on one of them counts it as not accepted)."""
        accepted = 0
        for d, t in zip(drafts.tokens, emitted, strict=False):
            if d != t:
                break
            accepted += 1
        if drafts.num_worker:
            accepted = max(0, min(drafts.num_worker, len(emitted) - 1))
        count = drafts.count
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += count
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        st = seq.spec
        if st is not None:
            st.drafted += count
            st.accepted += accepted
            k = self.config.num_speculative_tokens
            if accepted == 0:
                st.misses += 1
                st.cooldown = min(2 ** (st.misses - 1), MAX_COOLDOWN)
                st.depth = 1
            else:
                st.misses = 0
                st.depth = k if accepted == count else min(k, accepted + 1)
        return accepted
