"""Function tools on /v1/responses: the Responses shapes of tools, tool_choice and the
``function_call`` / ``function_call_output`` input items, turned into the chat request's, and
the ``function_call`` output items. Calls run through the chat path (services/gateway/tools.py)
and the detokenizer's parsers as on /v1/chat/completions."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from kvflow.services.gateway.convert import bad
from kvflow.services.gateway.protocol import _Body
from kvflow.shared.messages import ToolCallDelta


class FunctionCallItem(_Body):
    """An earlier call of the model, sent back in ``input``."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ``{"type", "function": {...}}``; other tool
    types (web search, file search, ...) need tools kvflow does not run: 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad(f"tools[{i}].type", f"only function tools are served (got {kind!r})")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": N}`` as chat's ``{"type": "function", "function":
    {"name": N}}``; the strings are the same."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_message(item: Any) -> dict[str, Any]:
    """One input item as a chat message (a ``function_call`` as an assistant's call)."""
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if isinstance(item, FunctionCallOutputItem):
        return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
    return {"role": item.role, "content": item.text()}


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive calls become one assistant message."""
    out: list[dict[str, Any]] = []
    for item in items:
        msg = chat_message(item)
        prev = out[-1] if out else None
        if msg.get("tool_calls") and prev is not None and prev.get("tool_calls"):
            prev["tool_calls"] += msg["tool_calls"]
        else:
            out.append(msg)
    return out


def renamed_param(param: str) -> str:
    """A chat tool field's name as a Responses client knows it."""
    return param.replace(".function.", ".").replace("messages", "input")


class FunctionCalls:
    """A response's ``function_call`` output items, built from the stream's tool call pieces
    (each call's first piece has its id and name, later ones append arguments)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.calls: list[dict[str, Any]] = []  # items, by call index

    def item_id(self, index: int) -> str:
        return "fc_" + uuid.uuid5(uuid.NAMESPACE_URL, f"{self.request_id}/{index}").hex

    def add(self, piece: ToolCallDelta) -> dict[str, Any] | None:
        """Take a piece; a call's first piece returns its new item (arguments still empty)."""
        while len(self.calls) <= piece.index:
            i = len(self.calls)
            self.calls.append(
                {
                    "type": "function_call",
                    "id": self.item_id(i),
                    "call_id": "",
                    "name": "",
                    "arguments": "",
                    "status": "in_progress",
                }
            )
        item = self.calls[piece.index]
        new = piece.id is not None
        if new:
            item["call_id"], item["name"] = piece.id, piece.name or ""
        added = dict(item) if new else None
        item["arguments"] += piece.arguments
        return added

    def finished(self, status: str) -> list[dict[str, Any]]:
        """The items with their own statuses once the response ends with ``status``: in an
        incomplete response (cut at the token limit) only the last call can have been cut, and
        only when its arguments are not yet a whole JSON value; every earlier call ended when
        the next began."""
        for i, item in enumerate(self.calls):
            cut = status == "incomplete" and i == len(self.calls) - 1
            item["status"] = (
                "incomplete" if cut and not _whole_json(item["arguments"]) else "completed"
            )
        return self.calls


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
