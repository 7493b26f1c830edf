"""What ``LLM.generate`` / ``chat`` / ``beam_search`` / ``embed`` return, with vLLM's class and
field names."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.shared.messages import PromptTokenLogprob, TokenLogprob


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` includes the prompt (as in vLLM); ``text`` is the generated text."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class EmbeddingOutput:
    """One prompt's vector (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """One input's class probabilities (vLLM's ``ClassificationOutput``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per input (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's ``ScoringRequestOutput``)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


# wire logprobs -> vLLM's output shapes


def token_logprobs(lp: TokenLogprob) -> dict[int, Logprob]:
    out = {
        tid: Logprob(v, r + 1, text)
        for r, (tid, (text, v)) in enumerate(zip(lp.top_ids, lp.top, strict=True))
    }
    if lp.token_id not in out:
        out[lp.token_id] = Logprob(lp.logprob, None, lp.token)
    return out


def prompt_logprobs_of(lps: list[PromptTokenLogprob]) -> list[dict[int, Logprob] | None]:
    out: list[dict[int, Logprob] | None] = []
    for p in lps:
        if p.logprob is None:
            out.append(None)
            continue
        entry = {tid: Logprob(v, r + 1, text) for r, (tid, text, v) in enumerate(p.top)}
        entry.setdefault(p.token_id, Logprob(p.logprob, p.rank, p.token))
        out.append(entry)
    return out
