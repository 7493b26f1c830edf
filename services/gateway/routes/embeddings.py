"""POST /v1/embeddings (OpenAI's, with vLLM's extras): one pipeline request per input, each
computed as a prefill whose pooled final hidden state comes back instead of tokens (see
docs/architecture.md, "Embeddings"; the path every pooling route shares: routes/pooling.py).

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``encoding_format`` "float" (a list of numbers) or "base64" (little-endian float32, as OpenAI
and vLLM encode it: the bytes the worker sent, untouched). ``dimensions`` is refused: the model
has no matryoshka representation, so a shorter vector would be a different, worse one (vLLM
refuses it for such models too). vLLM's ``truncate_prompt_tokens`` keeps an input's last N
tokens; vLLM's ``normalize`` turns the L2 normalization off. The pooling itself is the server's
``--pooling-type`` (unset: the model's own). Served by an embedding model, or a decoder served
for generate (its pooled hidden states); another task is a 400 naming it."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from kvflow.services.gateway.convert import bad, parse_request, prompt_items
from kvflow.services.gateway.routes.common import require_task
from kvflow.services.gateway.routes.pooling import (
    PoolingInput,
    PoolingJob,
    add_pooling_routes,
    check_truncate,
    floats,
    pooling_requests,
    prompt_tokens,
)
from kvflow.services.gateway.schemas import EmbeddingResponse
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.config import Settings
from kvflow.shared.messages import Delta, GenerateRequest, PoolingParams

router = APIRouter()
ROUTE = "/v1/embeddings"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body, then vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last N tokens
    normalize: bool | None = None  # vLLM's: false gives the pooled vector unnormalized


def embedding_inputs(req: EmbeddingRequest) -> list[tuple[str | None, list[int] | None]]:
    """``(text, token ids)`` per input, as completions read ``prompt`` (400s naming
    ``input``)."""
    return prompt_items(req.input, "input")


def embedding_requests(
    req: EmbeddingRequest, request_id: str, reply_to: str, settings: Settings, salt: str | None
) -> list[GenerateRequest]:
    """The pipeline requests of a body (ids ``<request_id>-<i>``), after the checks the gateway
    makes (the tokenizer checks lengths and the vocabulary)."""
    if req.dimensions is not None:
        raise bad(
            "dimensions",
            "this model does not support matryoshka representations; leave dimensions unset",
        )
    keep = check_truncate(req.truncate_prompt_tokens)
    inputs = [PoolingInput(text, ids) for text, ids in embedding_inputs(req)]
    normalize = True if req.normalize is None else req.normalize
    pooling = PoolingParams(settings.model.pooling_type, normalize, task="embed")
    return pooling_requests(inputs, pooling, request_id, reply_to, settings, salt, keep, "input")


def embedding_item(delta: Delta, index: int, encoding: str) -> dict[str, Any]:
    """One ``data`` entry from an input's final delta (its vector as float32 bytes)."""
    if encoding == "base64":
        vector: Any = base64.b64encode(delta.embedding).decode("ascii")
    else:
        vector = floats(delta)
    return {"object": "embedding", "embedding": vector, "index": index}


def embedding_response(
    request_id: str, model: str, deltas: list[Delta], encoding: str
) -> dict[str, Any]:
    tokens = prompt_tokens(deltas)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [embedding_item(d, i, encoding) for i, d in enumerate(deltas)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def embedding_job(
    state: GatewayState, body: bytes, rid: str, salt: str | None, route: str
) -> PoolingJob:
    req = parse_request(EmbeddingRequest, body)
    model, lora = await state.resolve_model(req.model)
    await require_task(state, "embed", route)
    gens = embedding_requests(req, rid, state.inbox, state.settings, salt)
    encoding = req.encoding_format or "float"
    return PoolingJob(gens, lambda deltas: embedding_response(rid, model, deltas, encoding), lora)


add_pooling_routes(router, (ROUTE,), "embeddings", "embd", embedding_job, EmbeddingResponse)
