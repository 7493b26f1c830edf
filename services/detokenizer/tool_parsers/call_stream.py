"""One tool call written as a JSON object, ``{"name": ..., "arguments"|"parameters": {...}}``,
turned into pieces while it is written: the first piece (index, id, name) once the name is
complete, then the arguments' own text as it arrives (its concatenation is the arguments value
exactly as the model wrote it, so ``json.loads`` of it gives the model's object)."""

from __future__ import annotations

import json
import logging
from enum import Enum

from kvflow.services.detokenizer.tool_parsers.base import new_call_id
from kvflow.services.detokenizer.tool_parsers.json_scan import JsonScanner
from kvflow.shared.messages import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")
log = logging.getLogger("kvflow.detokenizer")


class CallState(Enum):
    OPEN = "open"  # being written
    DONE = "done"  # complete (text after it in ``rest``)
    BAD = "bad"  # not a call, and nothing of it was sent: its text is content
    BROKEN = "broken"  # invalid after its first piece went out: ended where it broke


class CallStream:
    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""  # the object's text so far (and whatever followed it)
        self.state = CallState.OPEN
        self.started = False  # the first piece (id, name) was sent
        self._scan = JsonScanner()
        self._args_sent = 0  # index in ``text`` up to which the arguments were sent
        self._args_done = False

    @property
    def rest(self) -> str:
        """The text after the object (DONE) or from where it broke (BROKEN)."""
        stop = self._scan.end if self._scan.end is not None else self._scan.error
        return self.text[stop:] if stop is not None else ""

    def take(self, text: str, out: list[ToolCallDelta]) -> CallState:
        """Feed ``text`` (if any), appending its pieces to ``out``; the state after it. A call
        that broke off in its arguments is logged here (its parser drops the rest)."""
        if text:
            out += self.feed(text)
            if self.state == CallState.BROKEN:
                log.warning(
                    "tool call %d broke off in its arguments; its rest is dropped", self.index
                )
        return self.state

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self.state != CallState.OPEN:
            raise RuntimeError("feed after the call ended")
        self.text += text
        self._scan.scan(self.text)
        if not self._scan.members and self.text.lstrip()[:1] not in ("", "{"):
            self.state = CallState.BAD  # not an object
            return []
        out: list[ToolCallDelta] = []
        if not self.started and not self._start(out):
            self.state = CallState.BAD
            return []
        if self.started:
            self._arguments(out)
        self._settle(out)
        return out

    def _start(self, out: list[ToolCallDelta]) -> bool:
        """Send the first piece once the name is complete; False: this is no call."""
        m = self._scan.member("name")
        if m is None or m.end is None:
            return True  # not yet known
        name = json.loads(self.text[m.start : m.end])
        if not isinstance(name, str) or not name:
            return False
        out.append(ToolCallDelta(self.index, id=new_call_id(), name=name))
        self.started = True
        return True

    def _arguments(self, out: list[ToolCallDelta]) -> None:
        m = self._scan.member(*ARGUMENT_KEYS)
        if m is None or m.start is None or self._args_done:
            return
        hi = m.end if m.end is not None else self._scan.pos
        lo = max(self._args_sent, m.start)
        if hi > lo:
            _append(out, self.index, self.text[lo:hi])
            self._args_sent = hi
        self._args_done = m.end is not None

    def _settle(self, out: list[ToolCallDelta]) -> None:
        """Decide the call's state once the object is complete or broken."""
        if self._scan.end is not None:
            if not self.started:
                self.state = CallState.BAD  # an object without a name
                return
            if self._scan.member(*ARGUMENT_KEYS) is None:
                _append(out, self.index, "{}")  # a call without arguments
            self.state = CallState.DONE
        elif self._scan.error is not None:
            if not self.started:
                self.state = CallState.BAD
            elif self._args_done:  # e.g. the object's closing brace is missing
                self.state = CallState.DONE
            else:
                self.state = CallState.BROKEN


def _append(out: list[ToolCallDelta], index: int, arguments: str) -> None:
    if out and out[-1].index == index:
        out[-1].arguments += arguments
    else:
        out.append(ToolCallDelta(index, arguments=arguments))
