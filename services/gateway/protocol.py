"""The request bodies the gateway accepts, as pydantic models: OpenAI's fields, then vLLM's extras.

The models check types and shapes only; the sampling fields are declared from the feature table
(shared/sampling/features.py), whose checks run when the request is converted (convert.py). Bodies are parsed
by hand from these models (for OpenAI-shaped 400s) and the OpenAPI document carries them
(openapi.py). Unknown fields are ignored, as OpenAI clients send fields kvflow does not use
(``store``, ``metadata``...)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from kvflow.shared.sampling import FIELDS


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage so far on every chunk


class TextPart(_Body):
    """One part of a message's content; only text parts are served (no vision models)."""

    type: Literal["text"]
    text: str


class FunctionCallIn(_Body):
    name: str
    arguments: str | dict[str, Any]  # JSON text (OpenAI); an object is taken too


class ToolCallIn(_Body):
    """An assistant message's earlier call, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # accepted: the arguments always follow the schema when forced


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class JsonSchemaSpec(_Body):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Every sampling feature field the bodies declare (shared/sampling/features.py), each as
# ``type | None``: unset means the feature's default.
_SamplingFields: type[_Body] = create_model(  # type: ignore[call-overload]
    "SamplingFields",
    __base__=_Body,
    **{f.name: (f.type | None, f.body_default) for f in FIELDS if f.body},
)


class SamplingBody(_SamplingFields):  # type: ignore[misc,valid-type]
    """Fields shared by chat and completions: the sampling features', then OpenAI's and vLLM's
    request-level fields."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; kvflow keeps per-key usage instead (see API keys)
    response_format: ResponseFormat | None = None
    priority: int | None = 0  # lower values are scheduled first
    # vLLM's: only requests with the same salt share prefix-cache blocks (non-empty)
    cache_salt: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: logprobs entries name tokens ``token_id:N`` (the text is unchanged)
    return_tokens_as_token_ids: bool | None = None
    # vLLM extras kvflow does not implement: refused when set (never silently ignored)
    use_beam_search: bool | None = None
    length_penalty: float | None = None

    def unsupported(self) -> str | None:
        """The first field set that kvflow does not implement, if any."""
        if self.use_beam_search:
            return "use_beam_search"
        if self.length_penalty not in (None, 1.0):
            return "length_penalty"
        return None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        so = self.stream_options
        return bool(self.stream and so and so.include_usage and so.continuous_usage_stats)


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True  # vLLM extra
    # vLLM extras: leave the final message open and continue it; start the answer with the
    # final message's content when it has the answer's role
    continue_final_message: bool | None = False
    echo: bool | None = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # false: at most one call


# A string, a list of strings (a batch), token ids, or a list of token-id lists (a batch).
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingBody):
    prompt: Prompt
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None  # refused when set: no fill-in-the-middle model is served


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize with chat messages (through the model's chat template)."""

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    tools: list[ChatTool] | None = None  # rendered by the chat template as in generation
    return_token_strs: bool | None = False


class DetokenizeRequestBody(_Body):
    model: str | None = None
    tokens: list[int]
