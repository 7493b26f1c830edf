"""Structured output (JSON schema, regex, choice, EBNF grammar) compiled with xgrammar against the
model's vocabulary. The tokenizer service compiles each request's constraint to refuse bad ones
with a 400 before anything runs; the worker compiles the same constraint (same library, same
vocabulary, so it cannot fail there) and masks the logits with a per-request matcher.

xgrammar's GrammarCompiler caches compiled grammars by their source, so a schema is compiled once
per process however many requests use it.

JSON is generated compact (``{"a": 1, "b": [2, 3]}``: one space after ``:`` and ``,``, no
other whitespace): with free whitespace small models tend to emit newlines until max_tokens."""

from __future__ import annotations

import json
import threading
from typing import Any

from kvflow.shared.messages import StructuredOutput

KINDS = ("json", "regex", "choice", "grammar")
# response_format {"type": "json_object"}: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar)."""


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of a Hugging Face tokenizer; ``vocab_size`` is the model's (lm_head
    rows), which may differ from the tokenizer's."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )


class GrammarCompiler:
    """Compiles StructuredOutput constraints for one vocabulary (thread-safe, cached)."""

    def __init__(self, info: Any) -> None:
        import xgrammar as xgr

        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self.info.vocab_size)

    def compile(self, so: StructuredOutput) -> Any:
        """The xgrammar CompiledGrammar for ``so``; raises GrammarError saying what is wrong."""
        with self._lock:
            try:
                return self._compile(so)
            except GrammarError:
                raise
            except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
                raise GrammarError(_short(e)) from e

    def _compile(self, so: StructuredOutput) -> Any:
        c = self._compiler
        if so.kind == "json":
            # an object schema without properties means "any object", not "{}" (strict mode)
            strict = so.spec != JSON_OBJECT_SCHEMA
            return c.compile_json_schema(so.spec, any_whitespace=False, strict_mode=strict)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if not choices or not all(isinstance(x, str) and x for x in choices):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            return c.compile_grammar(choice_grammar(choices))
        if so.kind == "grammar":
            return c.compile_grammar(so.spec)
        raise GrammarError(f"unknown structured output kind {so.kind!r} (one of {KINDS})")


def _short(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; keep the reason."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    if ".cc:" in text and ": " in text:
        text = text.split(": ", 1)[1]
    return text
