"""A step's output columns as the runner builds them (StepResult's lists, entry by entry): a
request that verified drafts (speculative decoding) adds several consecutive entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import PromptLogprobs, SampleLogprobs

# a step's entries: request ids, tokens, finish reasons, tokens computed, logprobs, prompt
# logprobs, and each entry's output-token count
StepOut = tuple[
    list[str],
    list[int],
    list[int],
    int,
    list["SampleLogprobs | None"],
    list[PromptLogprobs],
    list[int],
]


@dataclass
class Emitted:
    """The StepResult's columns, built entry by entry."""

    ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)

    def add(self, rid: str, tok: int, reason: int, count: int, lp: SampleLogprobs | None) -> None:
        self.ids.append(rid)
        self.tokens.append(tok)
        self.reasons.append(reason)
        self.counts.append(count)
        self.logprobs.append(lp)
