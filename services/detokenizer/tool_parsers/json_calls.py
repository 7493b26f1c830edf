"""Tool calls written as bare JSON objects: vLLM's ``llama3_json`` parser (``{"name": ...,
"parameters"|"arguments": {...}}``, several joined by ``;``, optionally after
``<|python_tag|>``) and the text of ``tool_choice: "required"`` (the grammar makes it a JSON
array of such objects).

Text that does not start as the format says is all content. After the calls, whitespace and
separators are dropped; other text after them is content. A call that is not a call object
(nothing of it sent yet) goes out as content with everything after it; one that breaks after
its first piece ends there and the rest of the text is dropped."""

from __future__ import annotations

from enum import Enum

from kvflow.services.detokenizer.tool_parsers.base import Parsed, ToolParser
from kvflow.services.detokenizer.tool_parsers.call_stream import CallState, CallStream
from kvflow.shared.messages import ToolCallDelta

PYTHON_TAG = "<|python_tag|>"


class _Mode(Enum):
    LEAD = 0  # before the first call (whitespace, the tag, the array's "[")
    NEXT = 1  # a call object is due (or the array's "]")
    CALL = 2
    SEP = 3  # after a call: a separator or the end
    END = 4  # after the array's "]": only whitespace is due
    CONTENT = 5  # everything from here is content
    DROP = 6  # everything from here is dropped


class JsonCallsParser(ToolParser):
    def __init__(self, sep: str, array: bool = False, tag: str = "") -> None:
        self.tools_called = False
        self._sep, self._array, self._tag = sep, array, tag
        self._mode = _Mode.LEAD
        self._buf = ""
        self._call: CallStream | None = None
        self._calls = 0
        self._raw: list[str] | None = []  # all text, until a call starts

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if self._raw is not None:
            self._raw.append(text)
        calls: list[ToolCallDelta] = []
        while self._step(calls):
            pass
        if self._mode == _Mode.CONTENT:
            content, self._buf = self._buf, ""
            return content, calls
        return "", calls

    def finish(self) -> Parsed:
        content = ""
        if self._mode in (_Mode.LEAD, _Mode.CONTENT):
            content = self._buf
        elif self._mode == _Mode.CALL:
            assert self._call is not None
            if not self._call.started:  # unterminated and never a call: give it back
                content = self._given_back(self._call)
        self._buf = ""
        return content, []

    def _step(self, calls: list[ToolCallDelta]) -> bool:
        """Handle what the current mode can of the buffer; True: the mode changed."""
        if self._mode == _Mode.LEAD:
            return self._lead()
        if self._mode == _Mode.CALL:
            return self._in_call(calls)
        if self._mode in (_Mode.CONTENT, _Mode.DROP):
            if self._mode == _Mode.DROP:
                self._buf = ""
            return False
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            return False
        if self._mode == _Mode.NEXT and s[0] == "{":
            self._call, self._mode = CallStream(self._calls), _Mode.CALL
        elif self._mode == _Mode.SEP and s[0] == self._sep:
            self._buf, self._mode = s[1:], _Mode.NEXT
        elif self._array and self._mode != _Mode.END and s[0] == "]":
            self._buf, self._mode = s[1:], _Mode.END
        else:
            self._mode = _Mode.CONTENT
        return True

    def _lead(self) -> bool:
        s = self._buf.lstrip()
        if self._tag:
            if s.startswith(self._tag):
                s = s[len(self._tag) :].lstrip()
            elif self._tag.startswith(s):
                return False  # whitespace or a part of the tag so far
        if not s:
            return False
        if s[0] != ("[" if self._array else "{"):
            self._mode = _Mode.CONTENT  # not calls: all of the text is content
            return True
        self._buf = s[1:] if self._array else s
        self._mode = _Mode.NEXT
        return True

    def _in_call(self, calls: list[ToolCallDelta]) -> bool:
        call = self._call
        assert call is not None
        state = call.take(self._buf, calls)
        self._buf = ""
        self.tools_called = self.tools_called or call.started
        if call.started:
            self._raw = None
        if state == CallState.OPEN:
            return False
        if state == CallState.BAD:
            self._buf, self._mode = self._given_back(call), _Mode.CONTENT
            return True
        self._calls += 1
        self._buf = call.rest
        self._mode = _Mode.SEP if state == CallState.DONE else _Mode.DROP  # BROKEN: drop
        return True

    def _given_back(self, call: CallStream) -> str:
        """The text of a call that is none: before any call, all of the text (as written)."""
        return "".join(self._raw) if self._raw is not None else call.text


def llama3_json() -> JsonCallsParser:
    return JsonCallsParser(";", tag=PYTHON_TAG)


def required() -> JsonCallsParser:
    return JsonCallsParser(",", array=True)
