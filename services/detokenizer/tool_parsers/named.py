"""``tool_choice`` naming a function: the grammar made the whole text that function's arguments
object, so the first piece (id, name) goes out at once and every piece of text is arguments."""

from __future__ import annotations

from kvflow.services.detokenizer.tool_parsers.base import Parsed, ToolParser, new_call_id
from kvflow.shared.messages import ToolCallDelta


class NamedParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.tools_called = False
        self._name = name

    def feed(self, text: str) -> Parsed:
        if not self.tools_called:
            self.tools_called = True
            return "", [ToolCallDelta(0, id=new_call_id(), name=self._name, arguments=text)]
        return "", [ToolCallDelta(0, arguments=text)] if text else []

    def finish(self) -> Parsed:
        return "", []
