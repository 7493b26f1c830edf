"""Guided decoding in the worker: a grammar matcher per request masks the logits before sampling
and follows every sampled token. The grammar is compiled once per distinct constraint (the
compiler caches); the matcher is per request.

After a preemption or a migration the worker gets the sequence again (NewRequest with
``num_output_tokens > 0``) and recomputes prompt and generated tokens; ``Guide.replay`` feeds
the generated ones (positions >= prompt_len, possibly spread over several chunks) through a
fresh matcher, so the mask at the next sample is the one the request had before it moved."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from kvflow.shared.messages import ScheduledSeq, StructuredOutput
from kvflow.shared.structured_output import GrammarCompiler, GrammarError, tokenizer_info

log = logging.getLogger("kvflow.worker")


class Guide:
    """One request's matcher and how many of its output tokens it has accepted."""

    def __init__(
        self, compiled: Any, stop_token_ids: Sequence[int], num_output_tokens: int
    ) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.accepted = 0  # output tokens the matcher has seen
        self.to_replay = num_output_tokens  # generated before this worker got the request
        self.error: str | None = None

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def replay(self, seq: ScheduledSeq, prompt_len: int) -> None:
        """Accept the already generated tokens this chunk carries (after a resume)."""
        if self.accepted >= self.to_replay or self.error:
            return
        for i, tok in enumerate(seq.token_ids):
            j = seq.start_pos + i - prompt_len  # index among output tokens
            if j == self.accepted and j < self.to_replay:
                self.accept(tok)

    def accept(self, token: int) -> bool:
        """Follow one output token; False (and ``error`` set) if the grammar refuses it."""
        if self.error:
            return False
        if not self.matcher.accept_token(int(token)):
            self.error = f"token {token} is not allowed by the grammar"
            return False
        self.accepted += 1
        return True


def make_guide(
    compiler: GrammarCompiler,
    so: StructuredOutput,
    stop_token_ids: Sequence[int],
    num_output_tokens: int,
) -> Guide | None:
    """A Guide, or None with the reason logged if the constraint does not compile (the
    tokenizer service refuses such requests first, so this is a belt-and-braces path)."""
    try:
        return Guide(compiler.compile(so), sorted(stop_token_ids), num_output_tokens)
    except GrammarError as e:
        log.warning("structured output does not compile: %s", e)
        return None


@functools.lru_cache(maxsize=4)
def default_compiler(
    model: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompiler:
    """The compiler for the model a worker process serves (``model``: the ``--model`` setting,
    '' for the default model): its tokenizer is cached on disk."""
    from kvflow.services.worker import machine
    from kvflow.shared.model_source import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model), machine.cache_dir())
    return GrammarCompiler(tokenizer_info(tok, vocab_size, list(eos_token_ids)))


def compiler_for(runner: Any) -> GrammarCompiler:
    """``runner.grammar_compiler`` when set (tests, embedders), else the compiler of the model
    the runner loaded (``runner.model_path``)."""
    given = getattr(runner, "grammar_compiler", None)
    if given is not None:
        return given
    cfg = runner.config
    return default_compiler(runner.model_path, cfg.vocab_size, tuple(cfg.eos_token_ids))
