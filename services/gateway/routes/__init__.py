"""The gateway's HTTP routes as module-level handlers over the app's GatewayState (reached
through the ``Gateway`` dependency, routes/common.py), one module per kind of work:
completions.py (chat, completions, legacy /generate), responses.py (/v1/responses), tokens.py
(/tokenize, /detokenize), status.py (models, version, health, stats, metrics), embeddings.py
(/v1/embeddings), score.py (vLLM's /score and /rerank), classify.py (vLLM's /classify), over
pooling.py (the path the pooling routes share), lora.py (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter)."""

from __future__ import annotations

from pydantic import BaseModel

from kvflow.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequestBody,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvflow.services.gateway.responses_api import ResponsesRequest
from kvflow.services.gateway.routes import (
    classify,
    completions,
    embeddings,
    lora,
    responses,
    score,
    status,
    tokens,
)

ROUTERS = (
    completions.router,
    responses.router,
    tokens.router,
    status.router,
    embeddings.router,
    score.router,
    classify.router,
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
    **{path: [score.ScoreRequest] for path in score.SCORE_ROUTES},
    **{path: [score.RerankRequest] for path in score.RERANK_ROUTES},
    **{path: [classify.ClassificationRequest] for path in classify.ROUTES},
    "/v1/load_lora_adapter": [lora.LoadLoRAAdapterRequest],
    "/v1/unload_lora_adapter": [lora.UnloadLoRAAdapterRequest],
}
