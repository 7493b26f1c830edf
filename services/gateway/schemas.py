"""Response shapes, as pydantic models, for the OpenAPI document only: routes build their bodies
with the plain builders of responses.py (msgspec-encoded, on the per-token path) and return them
directly, so these models never validate anything at run time. Tests check that real responses
validate against the schemas generated from them (schemathesis' response conformance)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class VllmPromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry for one candidate token id."""

    logprob: float
    rank: int
    decoded_token: str


# one dict per prompt token (token id as text -> its entry), null for the first token
PromptLogprobsOut = list[dict[str, VllmPromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    # "assistant"; with add_generation_prompt false, the last message's role (vLLM's rule)
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: str
    model_config = {"extra": "allow"}


STREAM_NOTE = (
    "With `stream: true` the body is `text/event-stream`: `data: {chunk}` events (the "
    "`*.chunk` / `text_completion` objects of the OpenAI API), an `error` object if the request "
    "fails after the stream started, then `data: [DONE]`."
)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for OpenAI-shaped errors."""
    return {c: {"model": ErrorResponse, "description": "OpenAI error object"} for c in codes}


RESPONSES_STREAM_NOTE = (
    "With `stream: true` the body is `text/event-stream`: typed events (`event: <type>` and "
    "`data: {event}`) from `response.created` through `response.output_text.delta` to "
    "`response.completed` (or `response.incomplete`), or an `error` object if the request fails "
    "after the stream started."
)


class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponsesResponse(BaseModel):
    """OpenAI's Response object (text and function calls)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: Any
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Any
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    embedding: list[float] | str  # a string with encoding_format "base64"
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """OpenAI's embeddings list (vLLM adds ``id`` and ``created``)."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    """vLLM's /score answer: one score per text pair, in pair order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's index in the request
    document: RerankDocument | None = None  # absent with return_documents false
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """vLLM's /rerank answer (Jina's and Cohere's shape): documents by relevance, best first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable class's name
    probs: list[float]
    num_classes: int
    object: Literal["classification"]


class ClassificationResponse(BaseModel):
    """vLLM's /classify answer: class probabilities per input."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage
