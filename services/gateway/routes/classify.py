"""vLLM's POST /classify and /v1/classify: class probabilities per input, from a model served
for ``--task classify`` (a ``*ForSequenceClassification`` head: the softmax of its logits) or
``score`` (a cross-encoder's one class: its sigmoid); another task is a 400 naming it.

``input`` takes the forms of /v1/embeddings' (a string, strings, token ids, token-id lists),
one pipeline request each; ``truncate_prompt_tokens`` as there. Each answer names its most
probable class by the model's ``id2label`` (from the tokenizer, ``ModelInfo.labels``;
``LABEL_<i>`` where the model names none)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from kvflow.services.gateway.convert import parse_request, prompt_items
from kvflow.services.gateway.routes.common import check_task
from kvflow.services.gateway.routes.pooling import (
    PoolingInput,
    PoolingJob,
    add_pooling_routes,
    check_truncate,
    floats,
    pooling_requests,
    prompt_tokens,
)
from kvflow.services.gateway.schemas import ClassificationResponse
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.config import Settings
from kvflow.shared.messages import Delta, GenerateRequest, PoolingParams

router = APIRouter()
ROUTES = ("/classify", "/v1/classify")


class ClassificationRequest(BaseModel):
    """vLLM's classification body (text or token-id inputs)."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None


def classification_inputs(req: ClassificationRequest) -> list[PoolingInput]:
    """One input per text or token-id list (400s naming ``input``, as /v1/embeddings')."""
    return [PoolingInput(text, ids) for text, ids in prompt_items(req.input, "input")]


def classification_requests(
    served: str,
    route: str,
    inputs: list[PoolingInput],
    keep: int | None,
    request_id: str,
    reply_to: str,
    settings: Settings,
    salt: str | None,
) -> list[GenerateRequest]:
    """The pipeline requests for a model served for ``served`` (a 400 unless classify or
    score)."""
    check_task(served, "classify", route)
    pooling = PoolingParams("", task="classify")  # the tokenizer sets the head's row
    return pooling_requests(inputs, pooling, request_id, reply_to, settings, salt, keep, "input")


def label_of(index: int, labels: list[str]) -> str:
    return labels[index] if index < len(labels) else f"LABEL_{index}"


def classification_item(probs: list[float], index: int, labels: list[str]) -> dict[str, Any]:
    """One ``data`` entry: the probabilities and the most probable class's name."""
    best = max(range(len(probs)), key=probs.__getitem__)
    return {
        "index": index,
        "label": label_of(best, labels),
        "probs": probs,
        "num_classes": len(probs),
        "object": "classification",
    }


def classification_response(
    request_id: str, model: str, deltas: list[Delta], labels: list[str]
) -> dict[str, Any]:
    tokens = prompt_tokens(deltas)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [classification_item(floats(d), i, labels) for i, d in enumerate(deltas)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


async def classification_job(
    state: GatewayState, body: bytes, rid: str, salt: str | None, route: str
) -> PoolingJob:
    req = parse_request(ClassificationRequest, body)
    keep = check_truncate(req.truncate_prompt_tokens)
    inputs = classification_inputs(req)
    model, lora = await state.resolve_model(req.model)
    info = await state.model_info()
    gens = classification_requests(
        info.task, route, inputs, keep, rid, state.inbox, state.settings, salt
    )
    labels = list(info.labels)
    return PoolingJob(gens, lambda d: classification_response(rid, model, d, labels), lora)


add_pooling_routes(
    router, ROUTES, "classify", "classify", classification_job, ClassificationResponse
)
