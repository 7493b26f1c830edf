"""The gateway's FastAPI app: OpenAI-compatible routes in front of the NATS pipeline.

``create_app`` only assembles: the GatewayState (services/gateway/state.py, what the routes
share), the error handlers, the routers (services/gateway/routes/) and the OpenAPI document;
the app's lifespan connects the state to NATS and closes it."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from kvflow.services.gateway.errors import install_error_handlers
from kvflow.services.gateway.openapi import install_openapi
from kvflow.services.gateway.routes import BODY_MODELS, ROUTERS
from kvflow.services.gateway.routes.common import version
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.access.connect import AccessError
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect (unless given a bus) and listen on the gateway's inbox while the app serves."""
    state: GatewayState = app.state.gateway
    try:
        await state.start()
    except AccessError as e:  # re-raised by services/gateway/main.py after uvicorn gives up
        app.state.refused = e
        raise
    try:
        yield
    finally:
        await state.stop()


def create_app(settings: Settings, bus: Bus | None = None) -> FastAPI:
    """The app; its lifespan connects to NATS (unless ``bus`` is given) and subscribes to this
    gateway's inbox. ``app.state.gateway`` is the GatewayState (routes and tests read it)."""
    app = FastAPI(
        title="kvflow gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        **_no_fastapi_telemetry(),
    )
    app.state.gateway = GatewayState(settings, bus)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app, BODY_MODELS, version())
    return app


def _no_fastapi_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.160 traces every request itself (health checks and scrapes too) when an
    OpenTelemetry SDK is installed; the gateway's own span (tracing.py) is the request's
    server span, so FastAPI's are turned off where FastAPI has them."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
