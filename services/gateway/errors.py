"""Errors in the OpenAI shape, ``{"error": {"message", "type", "param", "code"}}``, for every
failure the gateway can meet: clients (and the openai SDK) read ``type``/``param`` to tell the
user what to fix, so no failure may leave as a bare 500 page or a FastAPI ``detail`` list."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvflow.gateway")

# The OpenAI SDK maps status codes to these exception names; using the same names in ``type``
# keeps the body and the status telling one story.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class APIError(Exception):
    """A request that ends in an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "InternalServerError")
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError) -> Response:
    headers = dict(err.headers)
    if err.status == 429 and "retry-after" not in {k.lower() for k in headers}:
        headers["Retry-After"] = "1"  # kvflow answers overload with 429 + Retry-After
    return Response(
        msgspec.json.encode(err.body()),
        status_code=err.status,
        media_type="application/json",
        headers=headers,
    )


# Pydantic names union members in ``loc`` ("str", "list[int]", "TextPart"); they are not
# fields the client wrote, so they are left out of the path shown to the user.
def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none"}
        or "[" in part
        or "-" in part
        or part[:1].isupper()
    )


def _loc_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(err: ValidationError | RequestValidationError) -> APIError:
    """The first validation problem as a 400 whose ``param`` is the top-level field at fault
    (``messages``, ``temperature``, ...), with the exact path in the message."""
    errors = err.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes body fields with "body"
        loc = loc[1:]
    path = _loc_path(loc)
    param = path.split(".")[0].split("[")[0] or None
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    message = f"{path}: {msg}" if path else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return APIError(400, message, "BadRequestError", param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to the OpenAI error shape."""

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ValidationError | RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
