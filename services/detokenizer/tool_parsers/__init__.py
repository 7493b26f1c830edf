"""Tool-call parsers for the detokenizer (issue 19): a request's ``ToolParsing`` picks one, and
the text that would go out as ``Delta.text`` goes through it: content stays text, calls become
``Delta.tool_calls`` pieces. Pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Callable

from kvflow.services.detokenizer.tool_parsers.base import Parsed, ToolParser, new_call_id
from kvflow.services.detokenizer.tool_parsers.guard import GuardedParser, ToolParserErrors
from kvflow.services.detokenizer.tool_parsers.hermes import HermesParser
from kvflow.services.detokenizer.tool_parsers.json_calls import (
    JsonCallsParser,
    llama3_json,
    required,
)
from kvflow.services.detokenizer.tool_parsers.named import NamedParser
from kvflow.shared.messages import ToolParsing

# the parsers of mode "auto", by --tool-call-parser name
PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": llama3_json,
}


def make_parser(tp: ToolParsing) -> ToolParser:
    """The parser for a request's ``ToolParsing``; ValueError for an unknown mode or parser."""
    if tp.mode == "auto":
        if tp.parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tp.parser!r} (known: {sorted(PARSERS)})")
        return PARSERS[tp.parser]()
    if tp.mode == "required":
        return required()
    if tp.mode == "named":
        if not tp.name:
            raise ValueError('tool parsing mode "named" needs a function name')
        return NamedParser(tp.name)
    raise ValueError(f"unknown tool parsing mode {tp.mode!r}")


__all__ = [
    "PARSERS",
    "GuardedParser",
    "HermesParser",
    "JsonCallsParser",
    "NamedParser",
    "Parsed",
    "ToolParser",
    "ToolParserErrors",
    "make_parser",
    "new_call_id",
]
