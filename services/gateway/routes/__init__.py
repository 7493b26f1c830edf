"""The gateway's HTTP routes as module-level handlers over the app's GatewayState (reached
through the ``Gateway`` dependency, routes/common.py), one module per kind of work:
completions.py (chat, completions, legacy /generate), responses.py (/v1/responses), tokens.py
(/tokenize, /detokenize), status.py (models, version, health, stats, metrics), embeddings.py
(/v1/embeddings), lora.py (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter)."""

from __future__ import annotations

from pydantic import BaseModel

from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequestBody,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from services.gateway.responses_api import ResponsesRequest
from services.gateway.routes import completions, embeddings, lora, responses, status, tokens

ROUTERS = (
    completions.router,
    responses.router,
    tokens.router,
    status.router,
    embeddings.router,
    lora.router,
)

# route path -> the model(s) its POST body may be, for the OpenAPI document (openapi.py): the
# routes read their bodies by hand, so FastAPI cannot see these
BODY_MODELS: dict[str, list[type[BaseModel]]] = {
    "/v1/chat/completions": [ChatCompletionRequest],
    "/v1/completions": [CompletionRequest],
    "/v1/responses": [ResponsesRequest],
    "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
    "/detokenize": [DetokenizeRequestBody],
    "/v1/embeddings": [embeddings.EmbeddingRequest],
    "/v1/load_lora_adapter": [lora.LoadLoRAAdapterRequest],
    "/v1/unload_lora_adapter": [lora.UnloadLoRAAdapterRequest],
}
