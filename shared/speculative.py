"""Speculative decoding settings (vLLM's ``--speculative-config`` JSON) and which requests may
speculate. Shared by the launcher and ``LLM`` (which check the setting before starting
anything), the scheduler (which proposes draft tokens) and the worker (which verifies them).

Two methods: ``ngram`` (prompt lookup: the continuation of the latest earlier occurrence of the
sequence's last n tokens, proposed by the scheduler) and ``draft_model`` (a smaller Llama with
the same vocabulary, in the worker, with its own paged KV cache; ``num_draft_layers``, kvflow's
own key, keeps only its first N layers: the target's own first layers make a self-speculative
draft without a second checkpoint)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvflow.shared.messages.params import SamplingParams
from kvflow.shared.sampling.derived import needs_token_history

METHODS = ("ngram", "draft_model")
_KNOWN_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "num_draft_layers",
}
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A ``--speculative-config`` that cannot be served; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` drafts at most per step; n-grams of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens are looked up (longest first); with ``disable_by_batch_size``
    a worker whose running batch reaches that size stops speculating (0: never). A draft
    model: ``model`` (a GGUF file or HF directory), its first ``num_draft_layers`` (0: all)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0
    model: str = ""
    num_draft_layers: int = 0

    @property
    def proposed_by_worker(self) -> bool:
        """Drafts come from a model in the worker, not from the scheduler's lookup."""
        return self.method == "draft_model"

    def to_json(self) -> str:
        return json.dumps(
            {
                "method": self.method,
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
                "disable_by_batch_size": self.disable_by_batch_size,
            }
            | (
                {"model": self.model, "num_draft_layers": self.num_draft_layers}
                if self.model
                else {}
            )
        )


def parse_speculative_config(raw: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The config a ``--speculative-config`` value (JSON text, or a dict from the Python API)
    asks for; None for an empty value. Raises SpeculativeConfigError naming what is wrong."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise SpeculativeConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise SpeculativeConfigError(
            f"--speculative-config: unknown key(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(_KNOWN_KEYS))})"
        )
    method = raw.get("method") or ("ngram" if raw.get("model") in ("ngram", "[ngram]") else None)
    if method is None:
        raise SpeculativeConfigError('--speculative-config needs "method" (e.g. "ngram")')
    if method not in METHODS:
        raise SpeculativeConfigError(
            f"--speculative-config: method {method!r} is not served by kvflow yet "
            f"(served: {', '.join(METHODS)})"
        )
    k = _int(raw, "num_speculative_tokens", None)
    if k is None:
        raise SpeculativeConfigError('--speculative-config needs "num_speculative_tokens"')
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(
            f"--speculative-config: num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}"
        )
    lo, hi = _int(raw, "prompt_lookup_min", None), _int(raw, "prompt_lookup_max", None)
    if lo is None and hi is None:  # vLLM's defaults
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    assert lo is not None and hi is not None
    if not 1 <= lo <= hi:
        raise SpeculativeConfigError(
            "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max"
        )
    off = _int(raw, "disable_by_batch_size", 0) or 0
    if off < 0:
        raise SpeculativeConfigError("--speculative-config: disable_by_batch_size must be >= 0")
    layers = _int(raw, "num_draft_layers", 0) or 0
    model = raw.get("model") or ""
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise SpeculativeConfigError(
                '--speculative-config: "draft_model" needs "model" (a GGUF file or HF directory)'
            )
        if layers < 0:
            raise SpeculativeConfigError("--speculative-config: num_draft_layers must be >= 0")
        return SpeculativeConfig(method, k, lo, hi, off, model, layers)
    return SpeculativeConfig(method, k, lo, hi, off)


def _int(raw: dict[str, Any], key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"--speculative-config: {key} must be an integer")
    return value


def can_speculate(p: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be drafted and verified in one step. Requests whose
    sampling depends on the tokens before each position (penalties, bad words: the history;
    grammars: the matcher's state; min_tokens still holding back EOS) are decoded one token a
    step: they work as without speculation, only not faster. Greedy and sampled requests
    (seeded or not: a seeded token's draw depends on the seed and its position only,
    services/worker/sampler.py ``counter_uniform``, so a rejected draft's row uses nothing up),
    logit bias, allowed tokens and logprobs all speculate."""
    return (
        p.structured_output is None
        and not needs_token_history(p)
        and num_output_tokens >= p.min_tokens
    )
