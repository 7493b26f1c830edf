"""The gateway's FastAPI app: OpenAI-compatible routes in front of the NATS pipeline.

Bodies are read and validated by hand (``parse_request``) rather than by FastAPI's body
injection, so invalid JSON and bad fields get OpenAI-shaped 400s naming the field, bodies over
``--max-body-bytes`` a 413 before they are read whole, and the route keeps the raw ASGI
``receive`` to race work against the client's disconnect. The OpenAPI document still carries the
body models (openapi.py) and the response models (schemas.py)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from services.gateway.convert import (
    chat_job,
    chat_messages,
    chat_template_flags,
    check_model,
    completion_job,
    new_request_id,
    parse_json,
    parse_request,
    validate_body,
)
from services.gateway.errors import APIError, error_response, install_error_handlers
from services.gateway.generation import CLIENT_CLOSED, serve
from services.gateway.legacy import legacy_generate
from services.gateway.openapi import install_openapi
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequestBody,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from services.gateway.responses import ChatFormat, CompletionFormat
from services.gateway.responses_api import (
    ResponsesFormat,
    ResponsesRequest,
    renamed,
    responses_job,
)
from services.gateway.schemas import (
    RESPONSES_STREAM_NOTE,
    STREAM_NOTE,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    ModelList,
    ResponsesResponse,
    TokenizeResponse,
    VersionResponse,
    error_responses,
)
from services.gateway.state import GatewayState
from services.gateway.tracing import RequestTrace
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    DetokenizeRequest,
    DetokenizeResult,
    SchedulerStats,
    TokenizeRequest,
    TokenizeResult,
)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def version() -> str:
    try:
        return metadata.version("kvflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def read_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None if the client left; 413 as soon as it is known to be over
    ``limit`` bytes (from Content-Length, or while it streams in)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is over this server's limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413, f"the request body is over this server's limit of {limit} bytes"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


def stats_dict(stats: SchedulerStats) -> dict[str, Any]:
    """The scheduler's counters as JSON-ready dicts (per-worker entries too)."""
    out = msgspec.structs.asdict(stats)
    out["workers"] = [msgspec.structs.asdict(w) for w in stats.workers]
    return out


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

    app = FastAPI(
        title="kvflow gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        **_no_fastapi_telemetry(),
    )
    app.state.gateway = state
    install_error_handlers(app)
    limit = settings.max_body_bytes

    async def echo_texts(job: Any) -> list[str] | None:
        """The text each prompt echoes: as given, decoded from its token ids, or (chat) the
        final message's content."""
        if not job.echo:
            return None
        out = []
        for gen in job.prompts:
            if gen.messages:
                out.append(gen.messages[-1].content)
            elif gen.prompt is not None:
                out.append(gen.prompt)
            else:
                msg = DetokenizeRequest(list(gen.prompt_token_ids or []))
                try:
                    res = await state.tokenizer_call(msg, DetokenizeResult)
                except APIError as e:
                    if e.status == 400:
                        e.param, e.message = "prompt", e.message.replace("tokens", "prompt", 1)
                    raise
                out.append(res.prompt)
        return out

    async def generate(request: Request, route: str, model_cls, prefix: str, make_job, fmt_cls):  # noqa: ANN001, ANN202
        """One generation route: auth, body, parse, job, response format, serve; traced."""
        trace = RequestTrace(route, request.headers, state.model_name)
        try:
            key = await state.auth.check(request)
            body = await read_body(request, limit)
            if body is None:
                trace.end(CLIENT_CLOSED, "client closed")
                return Response(status_code=CLIENT_CLOSED)
            req = parse_request(model_cls, body)
            model = check_model(req.model, state.model_name)
            rid = new_request_id(prefix)
            job = make_job(req, rid, state.inbox, time.time(), settings)
            fmt = fmt_cls(rid, model, include_usage=job.include_usage)
            fmt.with_logprobs, fmt.with_prompt_logprobs = job.logprobs, job.prompt_logprobs
            fmt.role, fmt.tokens_as_ids = job.role, job.tokens_as_ids
            fmt.take_request(req)
            texts = await echo_texts(job)
            return await serve(request, state, job, fmt, texts, _usage(state, key), trace)
        except BaseException as e:
            trace.end(getattr(e, "status", 500), getattr(e, "message", type(e).__name__))
            raise

    gen_errors = error_responses(400, 401, 404, 413, 429, 500, 503, 504)
    # one SSE event: ``data`` is a chunk as JSON text, an error object, or ``[DONE]``
    sse_event = {
        "type": "object",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "required": ["data"],
    }
    stream_content = {"text/event-stream": {"schema": sse_event}}

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": stream_content, "description": STREAM_NOTE}, **gen_errors},
    )
    async def chat_completions(request: Request) -> Response:
        return await generate(
            request, "/v1/chat/completions", ChatCompletionRequest, "chatcmpl", chat_job, ChatFormat
        )

    @app.post(
        "/v1/responses",
        response_model=ResponsesResponse,
        responses={
            200: {"content": stream_content, "description": RESPONSES_STREAM_NOTE},
            **gen_errors,
        },
    )
    async def responses(request: Request) -> Response:
        try:
            return await generate(
                request, "/v1/responses", ResponsesRequest, "resp", responses_job, ResponsesFormat
            )
        except APIError as e:  # e.g. a prompt too long, found by the tokenizer
            raise renamed(e) from None

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": stream_content, "description": STREAM_NOTE}, **gen_errors},
    )
    async def completions(request: Request) -> Response:
        return await generate(
            request, "/v1/completions", CompletionRequest, "cmpl", completion_job, CompletionFormat
        )

    @app.post("/generate", responses=gen_errors)
    async def generate_legacy(request: Request) -> Response:
        """vLLM's legacy API server endpoint: ``{"prompt", "n", "use_beam_search", ...}`` ->
        ``{"text": [...]}`` (services/gateway/legacy.py)."""
        await state.auth.check(request)
        body = await read_body(request, limit)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        return await legacy_generate(request, state, body)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 429))
    async def models(request: Request) -> Response:
        await state.auth.check(request)
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

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=error_responses(400, 401, 404, 413, 429, 503),
    )
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        await state.auth.check(request)
        body = await read_body(request, limit)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        data = parse_json(body)
        is_chat = "messages" in data
        req: Any = validate_body(
            TokenizeChatRequest if is_chat else TokenizeCompletionRequest, data
        )
        check_model(req.model, state.model_name)
        if is_chat:
            add_generation_prompt, continue_final = chat_template_flags(req)
            msg = TokenizeRequest(
                messages=chat_messages(req.messages),
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=bool(req.add_special_tokens),
                return_token_strs=bool(req.return_token_strs),
                continue_final_message=continue_final,
            )
        else:
            msg = TokenizeRequest(
                prompt=req.prompt,
                add_special_tokens=req.add_special_tokens is not False,
                return_token_strs=bool(req.return_token_strs),
            )
        res: TokenizeResult = await state.tokenizer_call(msg, TokenizeResult)
        return _json(
            {
                "count": len(res.tokens),
                "max_model_len": res.max_model_len,
                "tokens": res.tokens,
                "token_strs": res.token_strs,
            }
        )

    @app.post(
        "/detokenize",
        response_model=DetokenizeResponse,
        responses=error_responses(400, 401, 404, 413, 429, 503),
    )
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text."""
        await state.auth.check(request)
        body = await read_body(request, limit)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        req = parse_request(DetokenizeRequestBody, body)
        check_model(req.model, state.model_name)
        if any(not 0 <= t < 2**31 for t in req.tokens):
            raise APIError(400, "tokens: token ids must be in [0, 2^31)", param="tokens")
        res: DetokenizeResult = await state.tokenizer_call(
            DetokenizeRequest(list(req.tokens)), DetokenizeResult
        )
        return _json({"prompt": res.prompt})

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> Response:
        return _json({"version": version()})

    @app.get("/health", response_model=HealthResponse, responses=error_responses(503))
    async def health() -> Response:
        """200 only when a request could be served now: NATS, a scheduler, a worker, a
        tokenizer and a detokenizer."""
        answers = await asyncio.gather(
            state.scheduler_stats(),
            state.ping("tokenizer"),
            state.ping("detokenizer"),
            return_exceptions=True,
        )
        for a in answers:  # the first missing one, in the order of the request's path
            if isinstance(a, BaseException):
                return error_response(
                    a
                    if isinstance(a, APIError)
                    else APIError(503, str(a), "ServiceUnavailableError")
                )
        stats = answers[0]
        if stats.num_workers < 1:
            return error_response(
                APIError(503, "the scheduler has no workers yet", "ServiceUnavailableError")
            )
        roles = {w.role for w in stats.workers if not w.draining}
        if stats.workers and not ("both" in roles or {"prefill", "decode"} <= roles):
            return error_response(
                APIError(
                    503,
                    f"the scheduler's workers ({', '.join(sorted(roles)) or 'draining'}) cannot "
                    "both prefill and decode yet",
                    "ServiceUnavailableError",
                )
            )
        return _json({"status": "ok", **stats_dict(stats), "served_model": state.model_name})

    @app.get("/stats", responses=error_responses(503))
    async def stats() -> Response:
        """The scheduler's counters as JSON (tests check that all KV blocks are free again)."""
        s = await state.scheduler_stats()
        return _json(
            {
                **stats_dict(s),
                "gateway_id": state.gateway_id,
                "gateway_open_requests": len(state.streams),
                "gateway_aborts": state.num_aborts,
            }
        )

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus text format, vLLM's metric names: this gateway's series and, gathered
        over NATS, every other service's (labelled ``service`` and ``service_instance``);
        ``?scope=local``: this gateway's alone (for scrapers that reach every service)."""
        whole = request.query_params.get("scope", "") != "local"
        return Response(await state.metrics_text(whole), media_type=CONTENT_TYPE_LATEST)

    install_openapi(
        app,
        {
            "/v1/chat/completions": [ChatCompletionRequest],
            "/v1/completions": [CompletionRequest],
            "/v1/responses": [ResponsesRequest],
            "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
            "/detokenize": [DetokenizeRequestBody],
        },
        version(),
    )
    return app


def _no_fastapi_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.160 traces every request itself (health checks and scrapes too) when an
    OpenTelemetry SDK is installed; the gateway's own span (tracing.py) is the request's
    server span, so FastAPI's are turned off where FastAPI has them."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def _usage(state: GatewayState, key: str | None) -> Any:
    if key is None:
        return None
    return lambda prompt, completion: state.auth.record(key, prompt, completion)
