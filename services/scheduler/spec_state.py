"""One sequence's draft proposer, as the scheduler keeps it on the sequence (speculative
decoding, speculation.py): the n-gram index of its tokens and the back-off after misses. The
Speculator is the only one that changes a ``SpecState``; the index is a memo of positions,
brought up to date on each lookup (tokens are only ever appended)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CANDIDATES = 16  # latest occurrences of a suffix's shortest n-gram a lookup extends


class NgramIndex:
    """Every position that followed each n-gram of ``lo`` tokens in a sequence, brought up to
    date on each lookup (tokens are only ever appended); a lookup extends the match of the
    latest candidates backwards up to ``hi`` tokens. One tuple and one dict operation per token
    and per lookup: text with no repeats costs next to nothing."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position (exclusive) are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the earlier occurrence of the longest suffix of
        ``tokens`` (``lo..hi`` tokens; the latest among equally long) seen before; [] when
        none."""
        end, lo = len(tokens), self.lo
        # the n-gram ending at e (exclusive) is followed by tokens[e]: index e < end only (the
        # suffix itself has no continuation yet)
        for e in range(max(self.indexed, lo), end):
            key = tuple(tokens[e - lo : e])
            seen = self.after.get(key)
            if seen is None:
                self.after[key] = [e]
            else:
                seen.append(e)
        self.indexed = max(self.indexed, end)
        cands = self.after.get(tuple(tokens[end - lo :])) if end >= lo else None
        if not cands:
            return []
        best, best_n = -1, 0
        for at in reversed(cands[-MAX_CANDIDATES:]):
            n = lo
            while n < self.hi and at - n - 1 >= 0 and tokens[at - n - 1] == tokens[end - n - 1]:
                n += 1
            if n > best_n:
                best, best_n = at, n
                if n == self.hi:
                    break
        # a continuation that runs into the suffix repeats it (an LZ77-style copy)
        out: list[int] = []
        for j in range(best, best + k):
            out.append(tokens[j] if j < end else out[j - end])
        return out


@dataclass
class SpecState:
    """One sequence's proposer: its n-gram index, the drafts to propose next and the
    back-off after misses."""

    index: NgramIndex
    depth: int  # drafts to propose at most next time
    eligible: bool = True  # the request's parameters allow speculation (can_speculate)
    cooldown: int = 0  # steps left without proposals
    misses: int = 0  # verifications in a row that accepted nothing
    drafted: int = 0  # draft tokens verified, over the request's life (for its trace)
    accepted: int = 0  # of which accepted
