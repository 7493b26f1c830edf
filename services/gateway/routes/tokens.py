"""vLLM's /tokenize and /detokenize: the tokenizer service's answers over NATS request/reply,
through the same chat template and special-token rules as generation."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvflow.services.gateway.convert import (
    chat_messages,
    chat_template_flags,
    parse_json,
    parse_request,
    validate_body,
)
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.generation import CLIENT_CLOSED
from kvflow.services.gateway.protocol import (
    DetokenizeRequestBody,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvflow.services.gateway.routes.common import Gateway, authorized_body, json_response
from kvflow.services.gateway.schemas import DetokenizeResponse, TokenizeResponse, error_responses
from kvflow.services.gateway.tools import check_tools
from kvflow.shared.messages import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)

router = APIRouter()


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=error_responses(400, 401, 404, 413, 429, 503),
)
async def tokenize(request: Request, state: Gateway) -> Response:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    _, body = await authorized_body(request, state)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    data = parse_json(body)
    is_chat = "messages" in data
    req: Any = validate_body(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, data)
    await state.resolve_model(req.model)  # an adapter shares the base's tokenizer
    res: TokenizeResult = await state.tokenizer_call(tokenize_message(req, is_chat), TokenizeResult)
    return json_response(
        {
            "count": len(res.tokens),
            "max_model_len": res.max_model_len,
            "tokens": res.tokens,
            "token_strs": res.token_strs,
        }
    )


def tokenize_message(req: Any, is_chat: bool) -> TokenizeRequest:
    """The tokenizer's request for a /tokenize body (vLLM's defaults: a chat adds no special
    tokens unless asked, a prompt does unless told not to)."""
    if is_chat:
        add_generation_prompt, continue_final = chat_template_flags(req)
        return TokenizeRequest(
            messages=chat_messages(req.messages),
            tools=check_tools(req.tools or []),
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=bool(req.add_special_tokens),
            return_token_strs=bool(req.return_token_strs),
            continue_final_message=continue_final,
        )
    return TokenizeRequest(
        prompt=req.prompt,
        add_special_tokens=req.add_special_tokens is not False,
        return_token_strs=bool(req.return_token_strs),
    )


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=error_responses(400, 401, 404, 413, 429, 503),
)
async def detokenize(request: Request, state: Gateway) -> Response:
    """vLLM's /detokenize: token ids -> text."""
    _, body = await authorized_body(request, state)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    req = parse_request(DetokenizeRequestBody, body)
    await state.resolve_model(req.model)  # an adapter shares the base's tokenizer
    if any(not 0 <= t < 2**31 for t in req.tokens):
        raise APIError(400, "tokens: token ids must be in [0, 2^31)", param="tokens")
    res: DetokenizeResult = await state.tokenizer_call(
        DetokenizeRequest(list(req.tokens)), DetokenizeResult
    )
    return json_response({"prompt": res.prompt})
