"""The gateway's FastAPI app: OpenAI-compatible routes in front of the NATS pipeline.

Bodies are read and validated by hand (``parse_request``) rather than by FastAPI's body
injection, so invalid JSON and bad fields get OpenAI-shaped 400s naming the field, and the
route keeps the raw ASGI ``receive`` to race work against the client's disconnect."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from services.gateway.convert import (
    chat_to_generate,
    check_model,
    completion_to_generate,
    new_request_id,
    parse_request,
)
from services.gateway.errors import APIError, error_response, install_error_handlers
from services.gateway.generation import CLIENT_CLOSED, serve
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import ChatFormat, CompletionFormat
from services.gateway.state import GatewayState
from shared.bus import Bus
from shared.config import Settings


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def create_app(settings: Settings, bus: Bus | None = None) -> FastAPI:
    """The app; its lifespan connects to NATS (unless ``bus`` is given) and subscribes to this
    gateway's inbox. ``app.state.gateway`` is the GatewayState (tests read it)."""
    state = GatewayState(settings, bus)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvflow gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    install_error_handlers(app)

    async def read_body(request: Request) -> bytes | None:
        try:
            return await request.body()
        except ClientDisconnect:
            return None

    async def generate(
        request: Request,
        cls: type[ChatCompletionRequest] | type[CompletionRequest],
        id_prefix: str,
        to_generate: Any,
        fmt_cls: type[ChatFormat] | type[CompletionFormat],
    ) -> Response:
        """Chat and completions differ only in body, conversion and response shapes."""
        body = await read_body(request)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        req = parse_request(cls, body)
        model = check_model(req.model, state.model_name)
        request_id = new_request_id(id_prefix)
        gen = to_generate(req, request_id, state.inbox, time.time())
        fmt = fmt_cls(request_id, model, include_usage=req.include_usage())
        return await serve(request, state, gen, fmt, bool(req.stream), n=req.n or 1)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(
            request, ChatCompletionRequest, "chatcmpl", chat_to_generate, ChatFormat
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(
            request, CompletionRequest, "cmpl", completion_to_generate, CompletionFormat
        )

    @app.get("/v1/models")
    async def models() -> Response:
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
        return _json({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        """200 only when a request could be served now: NATS, a scheduler, and a worker."""
        try:
            stats = await state.scheduler_stats()
        except APIError as e:
            return error_response(e)
        if stats.num_workers < 1:
            return error_response(
                APIError(503, "the scheduler has no workers yet", "ServiceUnavailableError")
            )
        return _json(
            {"status": "ok", **msgspec.structs.asdict(stats), "served_model": state.model_name}
        )

    @app.get("/stats")
    async def stats() -> Response:
        """The scheduler's counters as JSON (tests check that all KV blocks are free again)."""
        s = await state.scheduler_stats()
        return _json(
            {
                **msgspec.structs.asdict(s),
                "gateway_id": state.gateway_id,
                "gateway_open_requests": len(state.streams),
                "gateway_aborts": state.num_aborts,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format, vLLM's metric names; engine series from the scheduler."""
        try:
            state.metrics.update_engine(
                await state.scheduler_stats(timeout=0.5), len(state.streams)
            )
        except APIError:
            pass  # request-level series are still worth serving
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
