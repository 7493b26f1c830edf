"""vLLM's scoring routes: POST /score and /v1/score (a score per text pair), /rerank, /v1/rerank
and /v2/rerank (Jina's and Cohere's shape: documents ordered by their score against a query).

How a pair is scored depends on what the model is served for (the tokenizer says:
``GatewayState.model_info``): a cross-encoder (``--task score``) reads both texts as one input
(``prompt`` and ``prompt_pair``, one pipeline request per pair) and its output is the score;
an embedding model (``--task embed``) embeds every distinct text once and a pair's score is the
cosine similarity of its two vectors, as vLLM does. Any other task is a 400 naming it.

/score pairs ``text_1`` with ``text_2`` (vLLM's newer names ``queries`` and ``documents`` are
read too) 1 to 1, 1 to N (one ``text_1`` against each ``text_2``) or N to N (element-wise);
/rerank pairs ``query`` with each of ``documents``. ``--max-request-sequences`` bounds the
pipeline requests: the pairs for a cross-encoder, the distinct texts for an embedding model."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from kvflow.services.gateway.convert import bad, parse_request
from kvflow.services.gateway.routes.common import check_task
from kvflow.services.gateway.routes.pooling import (
    PoolingInput,
    PoolingJob,
    add_pooling_routes,
    check_truncate,
    floats,
    pooling_requests,
    prompt_tokens,
)
from kvflow.services.gateway.schemas import RerankResponse, ScoreResponse
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.config import Settings
from kvflow.shared.messages import Delta, GenerateRequest, PoolingParams

router = APIRouter()
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")


class ScoreRequest(BaseModel):
    """vLLM's score body (text inputs)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "queries"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "documents"))
    truncate_prompt_tokens: int | None = None  # vLLM's: per input (a pair, for a cross-encoder)
    encoding_format: str | None = None  # vLLM's; scores are plain numbers: ignored
    user: str | None = None


class RerankRequest(BaseModel):
    """vLLM's rerank body (Jina's and Cohere's fields, text documents)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0  # the best N results; 0 (or less): all of them
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs of a /score body: 1 to 1, 1 to N or N to N (vLLM's rule;
    other lengths, or an empty list, are 400s naming the field)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts:
        raise bad("text_1", "must not be empty")
    if not seconds:
        raise bad("text_2", "must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise bad(
            "text_2",
            f"{len(firsts)} text_1 and {len(seconds)} text_2: pair them 1 to 1, 1 to N or N to N",
        )
    return list(zip(firsts, seconds, strict=True))


def rerank_pairs(req: RerankRequest) -> list[tuple[str, str]]:
    """The query against each document (no documents: a 400 naming ``documents``)."""
    if not req.documents:
        raise bad("documents", "must not be empty")
    return [(req.query, doc) for doc in req.documents]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0 for a zero vector)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    if norms == 0.0:
        return 0.0
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms


@dataclass
class PairScoring:
    """How a body's pairs are scored: its pipeline requests and, for an embedding model, the
    two requests (vectors) each pair's cosine takes; None: a cross-encoder's, one request per
    pair whose output is the pair's score."""

    requests: list[GenerateRequest]
    cosines: list[tuple[int, int]] | None = None

    def scores(self, deltas: list[Delta]) -> list[float]:
        """Each pair's score from the requests' final deltas (in request order)."""
        if self.cosines is None:
            return [floats(d)[0] for d in deltas]
        vectors = [floats(d) for d in deltas]
        return [cosine(vectors[a], vectors[b]) for a, b in self.cosines]


def pair_scoring(
    served: str,
    route: str,
    pairs: list[tuple[str, str]],
    request_id: str,
    reply_to: str,
    settings: Settings,
    salt: str | None,
    keep: int | None,
    param: str,
) -> PairScoring:
    """The pipeline requests scoring ``pairs`` with a model served for ``served`` (a 400
    unless score or embed); over ``--max-request-sequences`` is a 400 naming ``param``."""
    check_task(served, "score", route)
    if served == "score":
        inputs = [PoolingInput(a, pair=b) for a, b in pairs]
        pooling = PoolingParams("", task="score")  # the tokenizer sets the head's row
        gens = pooling_requests(inputs, pooling, request_id, reply_to, settings, salt, keep, param)
        return PairScoring(gens)
    index: dict[str, int] = {}  # each distinct text is embedded once
    for a, b in pairs:
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    inputs = [PoolingInput(text) for text in index]
    pooling = PoolingParams(settings.model.pooling_type, True, task="embed")  # /v1/embeddings'
    gens = pooling_requests(inputs, pooling, request_id, reply_to, settings, salt, keep, param)
    return PairScoring(gens, [(index[a], index[b]) for a, b in pairs])


def score_response(request_id: str, model: str, scores: list[float], tokens: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def rerank_response(
    request_id: str,
    model: str,
    documents: list[str],
    scores: list[float],
    tokens: int,
    top_n: int = 0,
    return_documents: bool = True,
) -> dict[str, Any]:
    """Documents by score, best first (ties in request order), the best ``top_n`` when it is
    positive; each with its text unless ``return_documents`` is false."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n > 0:
        order = order[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i}
        if return_documents:
            result["document"] = {"text": documents[i]}
        result["relevance_score"] = scores[i]
        results.append(result)
    return {"id": request_id, "model": model, "usage": {"total_tokens": tokens}, "results": results}


async def _scoring(
    state: GatewayState,
    pairs: list[tuple[str, str]],
    rid: str,
    salt: str | None,
    route: str,
    keep: int | None,
    param: str,
) -> PairScoring:
    info = await state.model_info()
    return pair_scoring(
        info.task, route, pairs, rid, state.inbox, state.settings, salt, keep, param
    )


async def score_job(
    state: GatewayState, body: bytes, rid: str, salt: str | None, route: str
) -> PoolingJob:
    req = parse_request(ScoreRequest, body)
    keep = check_truncate(req.truncate_prompt_tokens)
    pairs = score_pairs(req.text_1, req.text_2)
    model, lora = await state.resolve_model(req.model)
    scoring = await _scoring(state, pairs, rid, salt, route, keep, "text_2")

    def answer(deltas: list[Delta]) -> dict[str, Any]:
        return score_response(rid, model, scoring.scores(deltas), prompt_tokens(deltas))

    return PoolingJob(scoring.requests, answer, lora)


async def rerank_job(
    state: GatewayState, body: bytes, rid: str, salt: str | None, route: str
) -> PoolingJob:
    req = parse_request(RerankRequest, body)
    keep = check_truncate(req.truncate_prompt_tokens)
    pairs = rerank_pairs(req)
    model, lora = await state.resolve_model(req.model)
    scoring = await _scoring(state, pairs, rid, salt, route, keep, "documents")

    def answer(deltas: list[Delta]) -> dict[str, Any]:
        scores = scoring.scores(deltas)
        tokens = prompt_tokens(deltas)
        return rerank_response(
            rid, model, req.documents, scores, tokens, req.top_n, req.return_documents
        )

    return PoolingJob(scoring.requests, answer, lora)


add_pooling_routes(router, SCORE_ROUTES, "score", "score", score_job, ScoreResponse)
add_pooling_routes(router, RERANK_ROUTES, "rerank", "rerank", rerank_job, RerankResponse)
