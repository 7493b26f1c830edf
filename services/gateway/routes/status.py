"""What operators and clients ask about the gateway rather than of the model: /v1/models (and
/v1/models/{id}), /version, /health (200 only when a request could be served now), /stats and /metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvflow.services.gateway.errors import APIError, error_response
from kvflow.services.gateway.routes.common import Gateway, json_response, version
from kvflow.services.gateway.schemas import (
    HealthResponse,
    ModelCard,
    ModelList,
    VersionResponse,
    error_responses,
)
from kvflow.shared.messages import SchedulerStats

router = APIRouter()


def stats_dict(stats: SchedulerStats) -> dict[str, Any]:
    """The scheduler's counters as JSON-ready dicts (per-worker entries too)."""
    out = msgspec.structs.asdict(stats)
    out["workers"] = [msgspec.structs.asdict(w) for w in stats.workers]
    return out


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 429))
async def models(request: Request, state: Gateway) -> Response:
    await state.auth.check(request)
    return json_response({"object": "list", "data": await _cards(state)})


@router.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404, 429)
)
async def model(model_id: str, request: Request, state: Gateway) -> Response:
    """One model's card (the openai SDK's ``models.retrieve``): the base model or a LoRA
    adapter; 404 naming what is served."""
    await state.auth.check(request)
    cards = await _cards(state)
    for card in cards:
        if card["id"] == model_id:
            return json_response(card)
    names = ", ".join(f"`{c['id']}`" for c in cards)
    raise APIError(
        404, f"The model `{model_id}` does not exist. This server serves {names}.",
        "NotFoundError", "model",
    )  # fmt: skip


async def _cards(state: Any) -> list[dict[str, Any]]:
    """The base model's card, then each LoRA adapter's (vLLM's fields)."""
    if not state.max_model_len:
        try:
            await state.scheduler_stats(timeout=0.5)
        except APIError:
            pass  # listed without max_model_len until a scheduler answers
    card: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvflow",
        "root": state.model_name,
        "parent": None,
    }
    if state.max_model_len:
        card["max_model_len"] = state.max_model_len
    cards = [card]
    for ref in await state.loras.listed(state.bus):  # vLLM's: root is the adapter's path
        cards.append({**card, "id": ref.name, "root": ref.path, "parent": state.model_name})
    return cards


@router.get("/version", response_model=VersionResponse)
async def get_version() -> Response:
    return json_response({"version": version()})


def _unavailable(message: str) -> Response:
    return error_response(APIError(503, message, "ServiceUnavailableError"))


@router.get("/health", response_model=HealthResponse, responses=error_responses(503))
async def health(state: Gateway) -> Response:
    """200 only when a request could be served now: NATS, a scheduler, a worker, a tokenizer
    and a detokenizer."""
    answers = await asyncio.gather(
        state.scheduler_stats(),
        state.ping("tokenizer"),
        state.ping("detokenizer"),
        return_exceptions=True,
    )
    for a in answers:  # the first missing one, in the order of the request's path
        if isinstance(a, BaseException):
            return error_response(a) if isinstance(a, APIError) else _unavailable(str(a))
    stats = answers[0]
    assert isinstance(stats, SchedulerStats)
    if stats.num_workers < 1:
        return _unavailable("the scheduler has no workers yet")
    roles = {w.role for w in stats.workers if not w.draining}
    if stats.workers and not ("both" in roles or {"prefill", "decode"} <= roles):
        return _unavailable(
            f"the scheduler's workers ({', '.join(sorted(roles)) or 'draining'}) cannot "
            "both prefill and decode yet"
        )
    return json_response({"status": "ok", **stats_dict(stats), "served_model": state.model_name})


@router.get("/stats", responses=error_responses(503))
async def stats(state: Gateway) -> Response:
    """The scheduler's counters as JSON (tests check that all KV blocks are free again)."""
    s = await state.scheduler_stats()
    return json_response(
        {
            **stats_dict(s),
            "gateway_id": state.gateway_id,
            "gateway_open_requests": len(state.streams),
            "gateway_aborts": state.num_aborts,
        }
    )


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, state: Gateway) -> Response:
    """Prometheus text format, vLLM's metric names: this gateway's series and, gathered over
    NATS, every other service's (labelled ``service`` and ``service_instance``);
    ``?scope=local``: this gateway's alone (for scrapers that reach every service)."""
    whole = request.query_params.get("scope", "") != "local"
    return Response(await state.metrics_text(whole), media_type=CONTENT_TYPE_LATEST)
