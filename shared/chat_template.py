"""Chat templates: a conversation (with tools, tool calls and tool results) through a
tokenizer's Jinja template, for the tokenizer service and the Python API's ``LLM.chat``.

Hermes-style tool calling for ChatML models whose own template has no tools (SmolLM2):
``TOOL_TEMPLATE`` is used when a conversation has tools, calls or results and the model's
template would drop them; it renders a conversation without tools as the model's own does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.shared.messages import ChatMessage, ToolCall, ToolSpec

TOOL_TEMPLATE = Path(__file__).parent / "chat_templates" / "hermes_tools.jinja"


class ChatTemplateError(ValueError):
    """A conversation the template cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def read_chat_template(value: str) -> str:
    """``--chat-template``: a Jinja file, or (as vLLM accepts) the template text itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(
        f"--chat-template {value}: no such file (give a Jinja template file or its text)"
    )


def _convo(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates take them: a call's arguments as an object."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.arguments)
                except ValueError:
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ChatTemplateError(f"{param} is not valid JSON", param) from None
                fn = {"name": c.name, "arguments": args}
                calls.append({"id": c.id, "type": "function", "function": fn})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        if t.parameters is not None:
            fn["parameters"] = json.loads(t.parameters)
        out.append({"type": "function", "function": fn})
    return out


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[ToolSpec],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tokenize: bool,
    template: str | None = None,
) -> Any:
    """The conversation through the chat template (a list of token ids, or the text): ``template`` if
    given, else the tokenizer's. A conversation with tools or tool messages goes through
    kvflow's hermes template when the model's own template knows nothing of tools (it would
    drop them)."""
    if not messages:
        raise ChatTemplateError("messages must not be empty", "messages")
    has_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
    if template is None and has_tools and "tool" not in (tokenizer.chat_template or ""):
        template = TOOL_TEMPLATE.read_text()
    try:
        out = tokenizer.apply_chat_template(
            _convo(messages),
            tools=_tools(tools) or None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=tokenize,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # template errors (e.g. role order) are the client's to fix
        raise ChatTemplateError(f"chat template failed: {e}", "messages") from e
    if tokenize:  # transformers >= 5 gives a BatchEncoding
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return out


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def from_openai(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[ChatMessage], list[ToolSpec]]:
    """OpenAI-shaped messages (text content or text parts, an assistant's ``tool_calls``, a
    ``tool`` message's ``tool_call_id``) and function tools, as ``render_chat`` takes them
    (the Python API's ``LLM.chat``; the gateway checks HTTP bodies itself)."""
    out: list[ChatMessage] = []
    for m in messages:
        msg = ChatMessage(m["role"], _content(m.get("content")))
        for c in m.get("tool_calls") or []:
            fn = c["function"]
            args = fn.get("arguments", "{}")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            msg.tool_calls.append(ToolCall(c.get("id", ""), fn["name"], args))
        msg.tool_call_id, msg.name = m.get("tool_call_id"), m.get("name")
        out.append(msg)
    specs = []
    for t in tools or []:
        fn = t.get("function", t)  # chat's {"type", "function": {...}} or a flat function
        params = fn.get("parameters")
        params = None if params is None else json.dumps(params, ensure_ascii=False)
        specs.append(ToolSpec(fn["name"], fn.get("description"), params))
    return out, specs
