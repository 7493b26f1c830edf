"""vLLM's run-time LoRA API: ``POST /v1/load_lora_adapter`` ({"lora_name", "lora_path"}) and
``POST /v1/unload_lora_adapter`` ({"lora_name"}), behind the API key. The scheduler has every
live worker read and check the adapter before it exists (a corrupt or over-rank adapter is a 400
and nothing changes); success answers vLLM's plain-text line."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from kvflow.services.gateway.convert import parse_request
from kvflow.services.gateway.generation import CLIENT_CLOSED
from kvflow.services.gateway.routes.common import Gateway, authorized_body
from kvflow.services.gateway.schemas import error_responses
from kvflow.shared.messages import LoraLoad, LoraUnload

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides


# vLLM answers success as a plain-text line, errors as OpenAI error objects (JSON)
SUCCESS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "done"}}


@router.post(
    "/v1/load_lora_adapter",
    response_class=Response,
    responses={**SUCCESS, **error_responses(400, 401, 404, 413, 429, 503)},
)
async def load_lora_adapter(request: Request, state: Gateway) -> Response:
    _, body = await authorized_body(request, state)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    req = parse_request(LoadLoRAAdapterRequest, body)
    await state.loras.call(state.bus, LoraLoad(req.lora_name, req.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=Response,
    responses={**SUCCESS, **error_responses(400, 401, 404, 413, 429, 503)},
)
async def unload_lora_adapter(request: Request, state: Gateway) -> Response:
    _, body = await authorized_body(request, state)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    req = parse_request(UnloadLoRAAdapterRequest, body)
    await state.loras.call(state.bus, LoraUnload(req.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
