"""The streaming tool-call parser interface and what parsers share."""

from __future__ import annotations

import uuid

from kvflow.shared.messages import ToolCallDelta

Parsed = tuple[str, list[ToolCallDelta]]  # content to send now, tool-call pieces found


def new_call_id() -> str:
    """A call id as vLLM makes them (``random_tool_call_id``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """Turns a sequence's text, fed piece by piece, into content and tool-call pieces.

    ``feed(text)`` returns the content to send now and the pieces of calls found so far (text
    that may still turn out to be a call is held back); ``finish()`` flushes at the end of the
    sequence. ``tools_called``: whether any call was sent."""

    tools_called: bool = False

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0
