"""Hermes tool calls (vLLM's ``hermes`` parser): ``<tool_call>{"name": "f", "arguments":
{...}}</tool_call>``, possibly several, in the text.

Text outside calls is content; text that could be the start of ``<tool_call>`` is held back
until it is known. After a call, whitespace up to the next text is not content (the newlines
between calls). A ``<tool_call>`` whose text is not a call object (not JSON, no name) goes out
as content, tags included, as vLLM returns it. A call that breaks after its first piece went out
ends there (its arguments are what was sent) and its text up to ``</tool_call>`` is dropped."""

from __future__ import annotations

from enum import Enum

from kvflow.services.detokenizer.tool_parsers.base import Parsed, ToolParser, partial_suffix
from kvflow.services.detokenizer.tool_parsers.call_stream import CallState, CallStream
from kvflow.shared.messages import ToolCallDelta

START, END = "<tool_call>", "</tool_call>"


class _Mode(Enum):
    TEXT = 0  # outside calls
    CALL = 1  # inside <tool_call>, reading the object
    AFTER = 2  # after a call's object, before its </tool_call>
    BAD = 3  # inside a <tool_call> that is no call: content up to </tool_call>
    SKIP = 4  # the rest of a broken call: dropped up to </tool_call>


class HermesParser(ToolParser):
    def __init__(self) -> None:
        self.tools_called = False
        self._mode = _Mode.TEXT
        self._buf = ""  # text not yet handled
        self._call: CallStream | None = None
        self._calls = 0
        self._strip = False  # drop leading whitespace of the next content (after a call)

    def feed(self, text: str) -> Parsed:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls):
            pass
        return "".join(content), calls

    def finish(self) -> Parsed:
        content: list[str] = []
        if self._mode == _Mode.TEXT:
            self._content(content, self._buf)
        elif self._mode == _Mode.CALL:
            assert self._call is not None
            if not self._call.started:  # unterminated and never a call: give it back
                content.append(START + self._call.text)
        elif self._mode == _Mode.BAD:
            content.append(self._buf)
        self._buf = ""
        return "".join(content), []

    def _content(self, content: list[str], text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            content.append(text)

    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Handle what the current mode can of the buffer; True: the mode changed."""
        if self._mode == _Mode.TEXT:
            return self._text(content)
        if self._mode == _Mode.CALL:
            return self._in_call(content, calls)
        if self._mode == _Mode.AFTER:
            return self._after()
        return self._to_end(content, emit=self._mode == _Mode.BAD)

    def _text(self, content: list[str]) -> bool:
        i = self._buf.find(START)
        if i >= 0:
            self._content(content, self._buf[:i])
            self._buf = self._buf[i + len(START) :]
            self._call = CallStream(self._calls)
            self._mode = _Mode.CALL
            return True
        keep = len(self._buf) - partial_suffix(self._buf, START)
        self._content(content, self._buf[:keep])
        self._buf = self._buf[keep:]
        return False

    def _in_call(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        call = self._call
        assert call is not None
        state = call.take(self._buf, calls)
        self._buf = ""
        self.tools_called = self.tools_called or call.started
        if state == CallState.OPEN:
            return False
        if state == CallState.BAD:
            content.append(START)
            self._buf, self._mode, self._strip = call.text, _Mode.BAD, False
            return True
        self._calls += 1
        self._buf = call.rest
        self._mode = _Mode.AFTER if state == CallState.DONE else _Mode.SKIP  # BROKEN: drop
        return True

    def _after(self) -> bool:
        s = self._buf.lstrip()
        self._buf = s
        if not s or (END.startswith(s) and s != END):
            return False  # whitespace, or a part of </tool_call>
        if s.startswith(END):
            self._buf = s[len(END) :]
        self._mode, self._strip = _Mode.TEXT, True  # no </tool_call>: what follows is text
        return True

    def _to_end(self, content: list[str], emit: bool) -> bool:
        i = self._buf.find(END)
        if i >= 0:
            if emit:
                content.append(self._buf[: i + len(END)])
            self._buf = self._buf[i + len(END) :]
            self._mode, self._strip = _Mode.TEXT, not emit
            return True
        keep = len(self._buf) - partial_suffix(self._buf, END)
        if emit:
            content.append(self._buf[:keep])
        self._buf = self._buf[keep:]
        return False
