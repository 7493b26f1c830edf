"""A step's output as a runner builds it, and the one place a StepResult is made of it.

Every runner (services/worker/step_runner.py) fills a ``StepOut`` entry by entry (a request that
verified drafts adds several consecutive entries), and ``step_result`` turns it, or a failure,
into the message; the worker service's own failures (a stale plan, a crashed step, a
placeholder it cannot fill) go through ``step_result`` too."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.shared.messages import (
    PooledOutput,
    PromptLogprobs,
    SampleLogprobs,
    StepPlan,
    StepResult,
)


@dataclass
class StepOut:
    """The StepResult's columns, built entry by entry, and the step's other outputs."""

    ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # each entry's output-token count
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)
    num_computed: int = 0  # tokens run through the model
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embeddings: list[PooledOutput] = field(default_factory=list)  # vectors that end requests

    def add(self, rid: str, tok: int, reason: int, count: int, lp: SampleLogprobs | None) -> None:
        self.ids.append(rid)
        self.tokens.append(tok)
        self.reasons.append(reason)
        self.counts.append(count)
        self.logprobs.append(lp)


def step_result(
    worker_id: str,
    plan: StepPlan,
    out: StepOut | None = None,
    seconds: float = 0.0,
    error: str | None = None,
) -> StepResult:
    """``plan``'s StepResult: ``out``'s columns (the logprobs column only when an entry has
    some), or, for a failed step (``error``), no entries."""
    if error is not None or out is None:
        out = StepOut()
    lps = out.logprobs if any(lp is not None for lp in out.logprobs) else []
    return StepResult(
        worker_id=worker_id,
        step_id=plan.step_id,
        request_ids=out.ids,
        token_ids=out.tokens,
        finish_reasons=out.reasons,
        num_computed_tokens=out.num_computed,
        step_time_s=seconds,
        error=error,
        logprobs=lps,
        prompt_logprobs=out.prompt_logprobs,
        num_output_tokens=out.counts,
        epoch=plan.epoch,
        embeddings=out.embeddings,
    )
