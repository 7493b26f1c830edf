"""OpenAI's Responses API (POST /v1/responses), text in and text out, as vLLM serves it.

A request becomes a chat request (``instructions`` as the system message, then ``input``) and
runs through the same job, pipeline and serving loop as /v1/chat/completions; only the shapes
differ: the answer is one ``message`` output item, and a stream is the typed events
``response.created`` ... ``response.completed`` (named in each SSE ``event:`` line too). What
kvflow cannot do here is refused by name: stored responses (``previous_response_id``), tools
other than functions, reasoning, background runs, ``truncation: "auto"``, logprobs. Function
tools are served as on chat (``function_call`` output items; services/gateway/responses_tools.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvflow.services.gateway.convert import Job, bad, chat_job, validate_body
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import ChatCompletionRequest, _Body
from kvflow.services.gateway.responses import Echo, Format, Outcome, sse
from kvflow.services.gateway.responses_tools import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionCalls,
    chat_tool_choice,
    chat_tools,
    input_messages,
    renamed_param,
)
from kvflow.shared.config import Settings
from kvflow.shared.messages import ToolCallDelta
from kvflow.shared.sampling import FIELDS

# vLLM's sampling extras a Responses request may carry too (validated as in chat): the
# feature fields it does not name itself, and the priority
EXTRAS = frozenset([f.name for f in FIELDS if f.body and f.responses] + ["priority"])
# a chat field's name as a Responses client knows it, for error messages
PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses. vLLM's sampling extras (top_k, min_p, repetition_penalty, seed,
    stop, ...) are accepted beside these fields."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem] = Field(
        min_length=1
    )
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way (no previous_response_id)
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # refused when set: kvflow keeps no responses, runs no hosted tools, no reasoning model
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    # vLLM's: only requests with the same salt share prefix-cache blocks (non-empty)
    cache_salt: str | None = None


def _refusal(req: ResponsesRequest) -> APIError | None:
    if req.previous_response_id:
        return bad(
            "previous_response_id",
            "kvflow does not store responses: send the whole conversation in input",
        )
    if req.reasoning:
        return bad("reasoning", "the served model is not a reasoning model")
    if req.include:
        return bad("include", "no extra output can be included")
    if req.background:
        return bad("background", "background responses are not supported")
    if req.truncation == "auto":
        return bad("truncation", "only 'disabled' is supported: shorten the input instead")
    if req.top_logprobs:
        return bad("top_logprobs", "logprobs are not supported on /v1/responses")
    return None


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.name, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {**spec, "schema": fmt.json_schema}}


def renamed(e: APIError) -> APIError:
    """``e`` naming the Responses field where a chat field was checked."""
    new = PARAM_NAMES.get(e.param or "")
    if (
        new is None
        and e.param
        and (e.param.startswith("tools[") or e.param.startswith("messages["))
    ):
        new = renamed_param(e.param)
    if new is not None:
        e.message = new + e.message.removeprefix(e.param or "")
        e.param = new
    return e


def responses_job(
    req: ResponsesRequest,
    request_id: str,
    reply_to: str,
    arrival_time: float,
    settings: Settings | None = None,
) -> Job:
    """The chat job this request is: ``instructions`` as the system message, then ``input``."""
    refusal = _refusal(req)
    if refusal is not None:
        raise refusal
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages += input_messages(req.input)
    chat: dict[str, Any] = {
        k: v for k, v in (req.model_extra or {}).items() if k in EXTRAS and v is not None
    }
    chat |= {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "user": req.user,
        "response_format": _response_format(req.text.format if req.text else None),
        "cache_salt": req.cache_salt,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    try:
        job = chat_job(
            validate_body(ChatCompletionRequest, chat), request_id, reply_to, arrival_time, settings
        )
    except APIError as e:
        raise renamed(e) from None
    job.include_usage = True  # the last event, response.completed, carries the usage
    return job


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens,
        "output_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ResponsesFormat(Format):
    """The Response object and its stream events for a one-output chat job: a ``message`` item
    for the text (opened when text first comes) and a ``function_call`` item per tool call."""

    done: bytes = b""  # a Responses stream ends with response.completed, no [DONE]
    _req: ResponsesRequest | None = None
    _text: list[str] = field(default_factory=list)
    _finish: str | None = None
    _seq: int = 0
    _msg_index: int | None = None  # the message item's output_index, once opened
    _calls: FunctionCalls | None = None
    _call_index: dict[int, int] = field(default_factory=dict)  # call index -> output_index

    def take_request(self, req: Any) -> None:
        self._req = req
        self._calls = FunctionCalls(self.request_id)

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return f"event: {chunk['type']}\n".encode() + sse(chunk)

    @property
    def _item_id(self) -> str:
        return "msg_" + uuid.uuid5(uuid.NAMESPACE_URL, self.request_id).hex

    def _event(self, kind: str, **body: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **body}

    def _item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {
            "type": "message",
            "id": self._item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None
    ) -> dict[str, Any]:
        req = self._req
        assert req is not None, "take_request() first"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = req.text.format if req.text else None
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def _status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        started = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        self._msg_index = self._next_index()
        return [
            self._event(
                "response.output_item.added",
                output_index=self._msg_index,
                item=self._item(None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._item_id,
                output_index=self._msg_index,
                content_index=0,
                part=self._part(""),
            ),
        ]

    def _next_index(self) -> int:
        return len(self._call_index) + (self._msg_index is not None)

    def _call_events(self, pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
        assert self._calls is not None, "take_request() first"
        events = []
        for piece in pieces:
            added = self._calls.add(piece)
            if added is not None:
                self._call_index[piece.index] = self._next_index()
                out = self._call_index[piece.index]
                events.append(
                    self._event("response.output_item.added", output_index=out, item=added)
                )
            if piece.arguments:
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._calls.item_id(piece.index),
                        output_index=self._call_index.get(piece.index, 0),
                        delta=piece.arguments,
                    )
                )
        return events

    def _finish_events(self, finish_reason: str) -> list[dict[str, Any]]:
        assert self._calls is not None, "take_request() first"
        status = self._status(finish_reason)
        events = []
        if self._msg_index is None and not self._call_index:
            events += self._open_message()  # no output at all: an empty message
        if self._msg_index is not None:
            where = {"item_id": self._item_id, "output_index": self._msg_index, "content_index": 0}
            full = "".join(self._text)
            msg_status = status if not self._calls.calls else "completed"  # calls came after
            events += [
                self._event("response.output_text.done", **where, text=full, logprobs=[]),
                self._event("response.content_part.done", **where, part=self._part(full)),
                self._event(
                    "response.output_item.done",
                    output_index=self._msg_index,
                    item=self._item(full, msg_status),
                ),
            ]
        for i, item in enumerate(self._calls.finished(status)):
            out = self._call_index.get(i, 0)
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=out,
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=out, item=item),
            ]
        return events

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: Any = None,
        echo: Echo | None = None,
        prompt_lps: Any = None,
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> list[dict[str, Any]]:
        events = []
        if text:
            if self._msg_index is None:
                events += self._open_message()
            self._text.append(text)
            where = {"item_id": self._item_id, "output_index": self._msg_index, "content_index": 0}
            events.append(
                self._event("response.output_text.delta", **where, delta=text, logprobs=[])
            )
        events += self._call_events(tool_calls or [])
        if finish_reason is not None:
            self._finish = finish_reason
            events += self._finish_events(finish_reason)
        return events

    def _output(self, text: str, status: str, calls: FunctionCalls) -> list[dict[str, Any]]:
        """The message item (when there is text, or nothing else), then the calls, each item
        with its own status: the message is complete once a call followed it, and only a call
        cut at the token limit is incomplete (``FunctionCalls.finished``)."""
        items = [dict(c) for c in calls.finished(status)]
        msg_status = status if not items else "completed"
        return ([self._item(text, msg_status)] if text or not items else []) + items

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        assert self._calls is not None, "take_request() first"
        status = self._status(self._finish)
        output = self._output("".join(self._text), status, self._calls)
        body = self._response(status, output, _usage(prompt_tokens, completion_tokens))
        return self._event(f"response.{status}", response=body)

    def response(
        self, outs: list[Outcome], prompt_tokens: int, echoes: list[Echo | None] | None = None
    ) -> dict[str, Any]:
        [out] = outs
        calls = FunctionCalls(self.request_id)
        for piece in out.tool_calls:
            calls.add(piece)
        status = self._status(out.finish_reason)
        output = self._output(out.text, status, calls)
        return self._response(status, output, _usage(prompt_tokens, out.completion_tokens))
