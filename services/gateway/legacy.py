"""``POST /generate``: vLLM's legacy API server shape, for older clients and the examples that
circulate with it.

    {"prompt": "...", "n": 1, "use_beam_search": false, "temperature": 0.7, "max_tokens": 10,
     "stream": false, ...any other sampling parameter}
    -> {"text": ["<prompt><completion 1>", ...]}

Streaming answers newline-delimited JSON objects of the same shape, each with the text so far.
The sampling fields go through the same validation as /v1/completions (a 400 naming the field).
``use_beam_search`` runs shared/beam_search.py over the pipeline (width ``best_of`` or ``n``,
``length_penalty``; temperature must be 0) and returns the ``n`` best beams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvflow.services.gateway.cancel import SSEResponse, run_or_disconnect
from kvflow.services.gateway.convert import (
    bad,
    check_cache_salt,
    completion_job,
    new_request_id,
    parse_json,
    salt_job,
    tenant_salt,
    validate_body,
)
from kvflow.services.gateway.generation import CLIENT_CLOSED
from kvflow.services.gateway.protocol import CompletionRequest
from kvflow.services.gateway.state import GatewayState
from kvflow.services.gateway.streams import RequestHandle
from kvflow.shared.beam_search import beam_search, ended_by_eos, step_params, top_pairs
from kvflow.shared.fan_out import best, cumulative_logprob, expand
from kvflow.shared.messages import (
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    TokenizeRequest,
    TokenizeResult,
)


class NDJSONResponse(SSEResponse):
    """Newline-delimited JSON, with SSEResponse's disconnect handling."""

    media_type = "application/x-ndjson"


def _line(texts: list[str]) -> bytes:
    return json.dumps({"text": texts}).encode() + b"\n"


async def legacy_generate(
    request: Request, state: GatewayState, body: bytes, tenant: str | None = None
) -> Response:
    """``tenant``: the API key's prefix-cache tenant (``--cache-salt-per-key``), if any."""
    data = parse_json(body)
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be a non-empty string")
    stream = data.pop("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be a boolean")
    use_beam = data.pop("use_beam_search", False)
    if not isinstance(use_beam, bool):
        raise bad("use_beam_search", "must be a boolean")
    length_penalty = data.pop("length_penalty", 1.0)
    data.pop("early_stopping", None)  # HF's heuristic is what runs (shared/beam_search.py)
    if use_beam:
        salt = tenant_salt(tenant, check_cache_salt(data.get("cache_salt")))
        return await _beam(request, state, data, prompt, stream, length_penalty, salt)
    req = validate_body(CompletionRequest, {**data, "model": state.model_name, "stream": stream})
    job = completion_job(req, new_request_id("gen"), state.inbox, time.time(), state.settings)
    salt_job(job, tenant)
    handles = [await state.submit(g) for g in expand(job.prompts, job.best_of)]

    def close() -> None:
        for h in handles:
            h.close()

    if stream:
        return NDJSONResponse(_stream(prompt, handles), on_close=close)
    try:
        disconnected, done = await run_or_disconnect(request, _read_all(handles))
        if disconnected:
            return Response(status_code=CLIENT_CLOSED)
        assert done is not None
        # with best_of > n, completion_job asked every sequence for its logprobs
        done = best(done, job.n, lambda d: d[1])
        return _json({"text": [prompt + text for text, _ in done]})
    finally:
        close()


async def _read_one(h: RequestHandle) -> tuple[str, float]:
    text, cumulative = [], 0.0
    while True:
        delta = await h.next()
        text.append(delta.text)
        cumulative += cumulative_logprob(delta.logprobs)
        if delta.finish_reason is not None:
            return "".join(text), cumulative


async def _read_all(handles: list[RequestHandle]) -> list[tuple[str, float]]:
    return list(await asyncio.gather(*(_read_one(h) for h in handles)))


async def _stream(prompt: str, handles: list[RequestHandle]) -> AsyncIterator[bytes]:
    texts = [prompt] * len(handles)
    pending = {asyncio.ensure_future(h.next()): i for i, h in enumerate(handles)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                delta = task.result()
                texts[i] += delta.text
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(handles[i].next())] = i
            yield _line(texts)
    finally:
        for task in pending:
            task.cancel()


async def _beam(
    request: Request,
    state: GatewayState,
    data: dict[str, Any],
    prompt: str,
    stream: bool,
    length_penalty: Any,
    cache_salt: str | None = None,
) -> Response:
    n = data.get("n", 1)
    width = data.get("best_of") or n
    for name, value, lo in (("n", n, 1), ("best_of", width, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= 10:
            raise bad(name, "must be an integer in [1, 10] for beam search")
    if width < n:
        raise bad("best_of", f"must be >= n ({n})")
    if data.get("temperature", 0) not in (0, 0.0):
        raise bad("temperature", "must be 0 with use_beam_search (beam search is deterministic)")
    max_tokens = data.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens", "must be a positive integer")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float):
        raise bad("length_penalty", "must be a number")
    ignore_eos = bool(data.get("ignore_eos", False))
    tok = await state.tokenizer_call(TokenizeRequest(prompt=prompt), TokenizeResult)
    if len(tok.tokens) + max_tokens > tok.max_model_len:
        raise bad("max_tokens", f"prompt + max_tokens exceeds the model length {tok.max_model_len}")
    eos = _eos_token_ids(state.settings.model.path, state.settings.model.served_model_name)

    async def expand(seqs: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        params = step_params(k)
        base = new_request_id("beam")
        handles = [
            await state.submit(
                GenerateRequest(
                    f"{base}-{i}", state.inbox, params, prompt_token_ids=s, cache_salt=cache_salt
                )
            )
            for i, s in enumerate(seqs)
        ]
        try:
            deltas = await asyncio.gather(*(h.next() for h in handles))
        finally:
            for h in handles:
                h.close()
        return [top_pairs(d.logprobs[0].top_ids, d.logprobs[0].top) for d in deltas]

    async def search() -> list[str]:
        beams = await beam_search(
            tok.tokens, expand, width, max_tokens, eos, float(length_penalty), ignore_eos
        )
        texts = []
        for b in beams[:n]:
            shown = b.tokens[:-1] if ended_by_eos(b, eos, ignore_eos) else b.tokens
            out = await state.tokenizer_call(DetokenizeRequest(shown), DetokenizeResult)
            texts.append(prompt + out.prompt)
        return texts

    disconnected, texts = await run_or_disconnect(request, search())
    if disconnected:
        return Response(status_code=CLIENT_CLOSED)
    assert texts is not None
    if stream:  # the beams are known only at the end: one line

        async def one_line() -> AsyncIterator[bytes]:
            yield _line(texts)

        return NDJSONResponse(one_line(), on_close=lambda: None)
    return _json({"text": texts})


@functools.cache
def _eos_token_ids(model: str, served_name: str) -> list[int]:
    """The model's end-of-sequence ids (its config; read once)."""
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import resolve_model

    return list(load_config(resolve_model(model, served_name)).eos_token_ids)


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
