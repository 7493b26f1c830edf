"""An incremental JSON checker for one value: fed the growing text, it says how far the text is
valid JSON, where the value ends, and where each member of a top-level object starts and ends
(so a call's ``name`` can be read and its ``arguments`` streamed while they are written)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")

# states
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER = range(5)
_STRING, _ESCAPE, _UNICODE, _NUMBER_S, _LITERAL, _DONE, _ERROR = range(5, 12)


@dataclass
class Member:
    """A member of the top-level object: its key and the extent of its value's text."""

    key: str
    start: int | None = None
    end: int | None = None  # exclusive; None while the value is being written


class JsonScanner:
    """Checks one JSON value character by character (strict, as ``json.loads``). ``scan(text)``
    reads what was added to ``text`` since the last call. ``end``: the index after the value
    once it is complete; ``error``: the index of the first character that cannot continue it."""

    def __init__(self) -> None:
        self.pos = 0  # characters of the text read
        self.end: int | None = None
        self.error: int | None = None
        self.members: list[Member] = []  # of a top-level object
        self._state = _VALUE
        self._stack: list[str] = []  # open containers, "{" or "["
        self._in_key = False
        self._token_start = 0  # of the string, number or literal being read
        self._rest = ""  # of a literal being read
        self._hex = 0  # hex digits still due in a \\u escape
        self._empty_array = False  # an array just opened (so "]" may close it)

    @property
    def finished(self) -> bool:
        return self.end is not None or self.error is not None

    def scan(self, text: str) -> None:
        while self.pos < len(text) and not self.finished:
            self._char(text, self.pos)
            if self._state == _ERROR:
                self.error = self.pos
                return
            self.pos += 1
        if self._state == _DONE and self.end is None:
            self.end = self.pos

    def member(self, *keys: str) -> Member | None:
        """The first member with one of these keys whose value has started."""
        return next((m for m in self.members if m.key in keys and m.start is not None), None)

    def _top_object(self) -> bool:
        return len(self._stack) == 1 and self._stack[0] == "{"

    def _value_done(self, end: int) -> None:
        if not self._stack:
            self._state = _DONE
            self.end = end
            return
        if self._top_object():
            self.members[-1].end = end
        self._state = _AFTER

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        st = self._state
        if st == _STRING:
            self._string_char(text, i, c)
        elif st == _ESCAPE:
            if c == "u":
                self._state, self._hex = _UNICODE, 4
            else:
                self._state = _STRING if c in '"\\/bfnrt' else _ERROR
        elif st == _UNICODE:
            if c not in _HEX:
                self._state = _ERROR
            else:
                self._hex -= 1
                self._state = _UNICODE if self._hex else _STRING
        elif st == _NUMBER_S:
            if c in _NUMBER_CHARS:
                return
            if not _NUMBER.match(text, self._token_start, i):
                self._state = _ERROR
                return
            self._value_done(i)
            if self._state != _DONE:
                self._char(text, i)  # the character after the number is read as usual
        elif st == _LITERAL:
            self._literal_char(text, i, c)
        elif c in _WS:
            return
        elif st in (_VALUE, _KEY_OR_CLOSE, _KEY):
            self._start_char(i, c)
        elif st == _COLON:
            self._state = _VALUE if c == ":" else _ERROR
        elif st == _AFTER:
            self._after_char(c)
        else:  # _DONE: nothing may follow the value but whitespace
            self._state = _ERROR

    def _string_char(self, text: str, i: int, c: str) -> None:
        if c == "\\":
            self._state = _ESCAPE
        elif c == '"':
            if self._in_key:
                self._in_key = False
                self._state = _COLON
                if self._top_object():
                    self.members.append(Member(json.loads(text[self._token_start : i + 1])))
            else:
                self._value_done(i + 1)
        elif c < " ":
            self._state = _ERROR  # a raw control character: json.loads refuses it

    def _literal_char(self, text: str, i: int, c: str) -> None:
        if c != self._rest[0]:
            self._state = _ERROR
            return
        self._rest = self._rest[1:]
        if not self._rest:
            self._value_done(i + 1)

    def _start_char(self, i: int, c: str) -> None:
        """A key or a value begins (or an empty container closes)."""
        st = self._state
        if st == _KEY_OR_CLOSE and c == "}":
            self._close(i, "{")
            return
        if st in (_KEY_OR_CLOSE, _KEY):
            if c != '"':
                self._state = _ERROR
                return
            self._in_key, self._token_start, self._state = True, i, _STRING
            return
        if self._top_object():
            self.members[-1].start = i
        if c == "]" and self._stack and self._stack[-1] == "[" and self._empty_array:
            self._close(i, "[")
        elif c in "{[":
            self._stack.append(c)
            self._state = _KEY_OR_CLOSE if c == "{" else _VALUE
            self._empty_array = c == "["
            return
        elif c == '"':
            self._token_start, self._state = i, _STRING
        elif c == "-" or c.isdigit():
            self._token_start, self._state = i, _NUMBER_S
        elif c in _LITERALS:
            self._rest, self._state = _LITERALS[c][1:], _LITERAL
        else:
            self._state = _ERROR
        self._empty_array = False

    def _after_char(self, c: str) -> None:
        top = self._stack[-1]
        if c == ",":
            self._state = _KEY if top == "{" else _VALUE
            self._empty_array = False
        elif c == ("}" if top == "{" else "]"):
            self._close(self.pos, top)
        else:
            self._state = _ERROR

    def _close(self, i: int, kind: str) -> None:
        if not self._stack or self._stack[-1] != kind:
            self._state = _ERROR
            return
        self._stack.pop()
        self._value_done(i + 1)
