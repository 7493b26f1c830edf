"""``LLM.embed``, ``LLM.classify`` and ``LLM.score``: vLLM's offline pooling APIs over the
pipeline. Each input is one pipeline request with ``pooling`` set, prepared here the way the
tokenizer service prepares it (services/tokenizer/pooling_inputs.py: the task checked against
the served one, the model's pooling, an encoder's text pair and its token types), so the output
names the token ids that were used; a worker computes it and the vector comes back as the
request's one delta (docs/architecture.md, "Pooling models").

``score`` with a cross-encoder runs each pair through the model; with an embedding model it is
the cosine similarity of the two texts' embeddings, as vLLM does."""

from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvflow.client import PipelineClient, user_error
from kvflow.loop_thread import LoopThread
from kvflow.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvflow.sampling_params import Prompt, _prompt_list, prompt_cache_salt
from kvflow.services.tokenizer.pooling_inputs import PromptError, check_task, pooling_input
from kvflow.shared.messages import GenerateRequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from kvflow.shared.config import Settings
    from kvflow.shared.models.tasks import ServedTask


class PoolingLLM(Protocol):
    """What the pooling APIs read of the ``LLM`` (kvflow/llm.py) that calls them with itself."""

    settings: Settings
    tokenizer: Any  # transformers' tokenizer of the model
    served: ServedTask
    max_model_len: int
    max_in_flight: int
    _client: PipelineClient
    _ids: Iterator[int]
    _loop: LoopThread


_Input = tuple[list[int], PoolingParams, str | None]  # token ids, completed params, cache salt


def check_truncation(keep: int | None) -> None:
    if keep is not None and (keep == 0 or keep < -1):
        raise ValueError("truncate_prompt_tokens: must be -1 (the model length) or >= 1")


def prepared(
    llm: PoolingLLM, prompt: Prompt, task: str, keep: int | None, pair: str | None = None
) -> _Input:
    """One input's token ids and PoolingParams as the tokenizer service would make them."""
    salt = prompt_cache_salt(prompt)
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        text = prompt.get("prompt") if ids is None else None
    elif isinstance(prompt, str):
        text, ids = prompt, None
    else:
        text, ids = None, list(prompt)
    req = GenerateRequest(
        "", "", SamplingParams(max_tokens=1), text, ids, truncate_prompt_tokens=keep
    )
    req.prompt_pair = pair
    ms = llm.settings.model
    req.pooling = PoolingParams(ms.pooling_type, True, task)
    try:
        ids, params = pooling_input(llm.tokenizer, req, llm.served, llm.max_model_len)
    except PromptError as e:
        raise ValueError(f"input: {e}") from None
    if not ids or len(ids) > llm.max_model_len:
        raise ValueError(
            f"input: {len(ids)} tokens; this model takes 1 to {llm.max_model_len} "
            "(truncate_prompt_tokens=-1 truncates to the limit)"
        )
    return ids, params, salt


async def pool_all(llm: PoolingLLM, inputs: list[_Input], use_tqdm: bool, desc: str) -> list[bytes]:
    """Each prepared input's pooled output (float32 bytes), in input order; at most
    ``llm.max_in_flight`` in the pipeline at a time."""
    from tqdm import tqdm

    window = asyncio.Semaphore(llm.max_in_flight)
    bar = tqdm(total=len(inputs), desc=desc, disable=not use_tqdm or len(inputs) < 2,
               file=sys.stderr)  # fmt: skip

    async def one(ids: list[int], params: PoolingParams, salt: str | None) -> bytes:
        rid = f"{llm._client.client_id}-{next(llm._ids)}"
        req = GenerateRequest(
            rid, "", SamplingParams(max_tokens=1), None, ids, cache_salt=salt, pooling=params
        )
        async with window:
            got = await llm._client.generate(req)
        bar.update(1)
        if got.finish_reason == "error" or not got.embedding:
            raise RuntimeError(f"the pooling request {rid} failed in the pipeline")
        return got.embedding

    tasks = [asyncio.ensure_future(one(*x)) for x in inputs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        raise user_error(e) from None
    finally:
        for t in tasks:
            t.cancel()
        bar.close()


def _floats(data: bytes) -> list[float]:
    return array("f", data).tolist()  # hosts are little-endian


def _per_prompt(
    llm: PoolingLLM, prompts: Prompt | Sequence[Prompt], task: str, keep: int | None, use_tqdm: bool
) -> list[tuple[list[float], list[int]]]:
    """Each prompt's pooled output for ``task`` and the token ids that ran, in input order."""
    check_truncation(keep)
    inputs = [prepared(llm, p, task, keep) for p in _prompt_list(prompts)]
    desc = {"embed": "Embedded prompts", "classify": "Classified prompts"}[task]
    got = llm._loop.run(pool_all(llm, inputs, use_tqdm, desc))
    return [(_floats(v), ids) for v, (ids, _, _) in zip(got, inputs, strict=True)]


def embed(
    llm: PoolingLLM, prompts: Prompt | Sequence[Prompt], keep: int | None, use_tqdm: bool
) -> list[EmbeddingRequestOutput]:
    outs = _per_prompt(llm, prompts, "embed", keep, use_tqdm)
    return [
        EmbeddingRequestOutput(str(i), EmbeddingOutput(v), ids) for i, (v, ids) in enumerate(outs)
    ]


def classify(
    llm: PoolingLLM, prompts: Prompt | Sequence[Prompt], keep: int | None, use_tqdm: bool
) -> list[ClassificationRequestOutput]:
    outs = _per_prompt(llm, prompts, "classify", keep, use_tqdm)
    return [
        ClassificationRequestOutput(str(i), ClassificationOutput(v), ids)
        for i, (v, ids) in enumerate(outs)
    ]


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one to one, one to many, or many to as many."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("score: text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"score: text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
            "or as many as text_2"
        )
    return list(zip(first, second, strict=True))


def score(
    llm: PoolingLLM,
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    keep: int | None,
    use_tqdm: bool,
) -> list[ScoringRequestOutput]:
    check_truncation(keep)
    pairs = score_pairs(text_1, text_2)
    if llm.served.task == "embed":  # the cosine of the two embeddings
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        inputs = [prepared(llm, t, "embed", keep) for t in texts]
        got = llm._loop.run(pool_all(llm, inputs, use_tqdm, "Embedded texts"))
        vec = {t: torch.tensor(_floats(v)) for t, v in zip(texts, got, strict=True)}
        ids = {t: x[0] for t, x in zip(texts, inputs, strict=True)}
        return [
            ScoringRequestOutput(
                str(i),
                ScoringOutput(torch.cosine_similarity(vec[a], vec[b], dim=0).item()),
                ids[a] + ids[b],
            )
            for i, (a, b) in enumerate(pairs)
        ]
    try:
        check_task(llm.served, "score")
    except PromptError as e:
        raise ValueError(str(e)) from None
    inputs = [prepared(llm, a, "score", keep, pair=b) for a, b in pairs]
    got = llm._loop.run(pool_all(llm, inputs, use_tqdm, "Scored pairs"))
    return [
        ScoringRequestOutput(str(i), ScoringOutput(_floats(v)[0]), ids)
        for i, (v, (ids, _, _)) in enumerate(zip(got, inputs, strict=True))
    ]
