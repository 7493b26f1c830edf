"""OpenAI's Responses API route, /v1/responses: the generation path of completions.py with the
Responses request and format (services/gateway/responses_api.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.responses_api import (
    ResponsesFormat,
    ResponsesRequest,
    renamed,
    responses_job,
)
from kvflow.services.gateway.routes.common import GENERATION_ERRORS, STREAM_CONTENT, Gateway
from kvflow.services.gateway.routes.completions import generate
from kvflow.services.gateway.schemas import RESPONSES_STREAM_NOTE, ResponsesResponse

router = APIRouter()


@router.post(
    "/v1/responses",
    response_model=ResponsesResponse,
    responses={
        200: {"content": STREAM_CONTENT, "description": RESPONSES_STREAM_NOTE},
        **GENERATION_ERRORS,
    },
)
async def responses(request: Request, state: Gateway) -> Response:
    try:
        return await generate(
            request,
            state,
            "/v1/responses",
            ResponsesRequest,
            "resp",
            responses_job,
            ResponsesFormat,
        )
    except APIError as e:  # e.g. a prompt too long, found by the tokenizer
        raise renamed(e) from None
