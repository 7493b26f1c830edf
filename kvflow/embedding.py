"""``LLM.embed``: vLLM's offline embedding API over the pipeline. Each prompt is one pipeline
request with ``pooling`` set (the server's ``--pooling-type``, L2-normalized): the tokenizer
checks it, a worker computes the prompt and pools its final hidden states, and the vector comes
back as the request's one delta (docs/architecture.md, "Embeddings")."""

from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.outputs import EmbeddingOutput, EmbeddingRequestOutput
from kvflow.sampling_params import Prompt, _prompt_list
from shared.messages import GenerateRequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from kvflow.llm import LLM


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: the model's length),
    the tokenizer service's rule, applied here so the output names the ids that were used."""
    if keep is not None and (keep == 0 or keep < -1):
        raise ValueError("truncate_prompt_tokens: must be -1 (the model length) or >= 1")
    if keep == -1:
        keep = max_model_len
    return ids[-keep:] if keep and len(ids) > keep else ids


async def embed_all(
    llm: LLM,
    prompts: Prompt | Sequence[Prompt],
    truncate_prompt_tokens: int | None = None,
    use_tqdm: bool = True,
) -> list[EmbeddingRequestOutput]:
    """One EmbeddingRequestOutput per prompt, in input order; at most ``llm.max_in_flight``
    prompts in the pipeline at a time. A refused prompt raises ValueError naming ``input``."""
    from tqdm import tqdm

    from kvflow.llm import _as_user_error

    items = [llm._tokenize(p) for p in _prompt_list(prompts)]
    jobs = [(truncated(ids, truncate_prompt_tokens, llm.max_model_len), s) for _, ids, s in items]
    pooling = PoolingParams(llm.settings.model.pooling_type, normalize=True)
    window = asyncio.Semaphore(llm.max_in_flight)
    bar = tqdm(total=len(jobs), desc="Embedded prompts", disable=not use_tqdm or len(jobs) < 2,
               file=sys.stderr)  # fmt: skip

    async def one(ids: list[int], salt: str | None) -> EmbeddingRequestOutput:
        rid = f"{llm._client.client_id}-{next(llm._ids)}"
        req = GenerateRequest(
            rid, "", SamplingParams(max_tokens=1), None, ids, cache_salt=salt, pooling=pooling
        )
        async with window:
            got = await llm._client.generate(req)
        bar.update(1)
        if got.finish_reason == "error" or not got.embedding:
            raise RuntimeError(f"the embedding of {rid} failed in the pipeline")
        return EmbeddingRequestOutput(rid, EmbeddingOutput(array("f", got.embedding).tolist()), ids)

    tasks = [asyncio.ensure_future(one(ids, salt)) for ids, salt in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        raise _as_user_error(e) from None
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
