"""The simulated worker backend (``--worker-backend sim``): the real worker service, plans, KV
block accounting, transfers and result messages, with the model replaced by a step-time model
and deterministic tokens. It needs no weights, so it measures what the pipeline itself costs
(``kvflow bench pipeline``) and serves scale tests of stacks with many workers (as llm-d's
inference simulator and Dynamo's mocker engine do).

What it keeps real:

- every plan is checked as the model runner checks it (block tables cover the chunk, block ids
  exist, sampled requests are known), and the chunk's tokens are written into the paged KV
  cache at the slots the block table gives: the cache holds token ids (K) and positions (V), one
  int64 each, so moving blocks between workers (disaggregated decode, the host and Redis tiers)
  moves real bytes;
- a sampled token depends on what the cache holds: it is a hash of the two tokens before the
  position (read back from their KV slots), the position, and, when sampling is random, the
  seed or the request id. Greedy output is therefore a function of the context, like a real
  greedy model: the same prompt gives the same text, n > 1 greedy siblings agree, and a KV
  block that arrives damaged or in the wrong place changes the output;
- stopping: max_tokens, max_model_len, stop_token_ids, min_tokens (the tokens never include the
  model's special tokens, so EOS never comes unless a stop id is asked for);
- logprobs come back in the usual shape, as a point-mass distribution (logprob 0.0).

Embedding requests get a vector of ``SIM_EMBEDDING_DIM`` values, a deterministic function of
the last two tokens in the cache and the prompt length (normalized), so they flow through the
pipeline as with a model.

What it does not do: structured output (no logits to mask: such requests end with an error
finish), prompt logprobs (none are sent), penalties and bias (nothing to apply them to).

The step takes the host work plus the model's time: ``--sim-step-ms`` (fixed) or the cost model
``--sim-cost-model`` (shared/step_cost.py, a JSON of its coefficients, or ``cpu`` for the one
fitted to SmolLM2 on this project's CPU)."""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.services.worker import speculation
from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.pooling import pooled_output
from kvflow.services.worker.runner import finish_rule
from kvflow.services.worker.step_output import StepOut, step_result
from kvflow.shared.messages import (
    FinishReason,
    NewRequest,
    SampleLogprobs,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from kvflow.shared.model_source import ModelSource
from kvflow.shared.sampling import GREEDY_EPS
from kvflow.shared.step_cost import StepCostModel

log = logging.getLogger("kvflow.worker")


@dataclass
class SimRequest:
    params: SamplingParams
    prompt_len: int
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    salt: int  # 0 for greedy; the seed, or a hash of the request id, when sampling is random
    embedding: bool = False  # an embedding request: a vector, not a token


SIM_EMBEDDING_DIM = 64


def step_time_fn(step_ms: float, cost_model: str) -> Callable[[StepPlan], float]:
    """Seconds of model time for a plan: a cost model (a JSON file of StepCostModel's
    coefficients, or ``cpu`` for its defaults) when given, else ``step_ms`` per step."""
    if cost_model:
        model = StepCostModel() if cost_model == "cpu" else StepCostModel.from_json(cost_model)
        return model.step_time
    fixed = max(0.0, step_ms) / 1000.0
    return lambda _plan: fixed


class SimRunner:
    """Runs StepPlans like ModelRunner (same interface for WorkerService) without a model."""

    def __init__(
        self,
        vocab_ids: Iterable[int],
        eos_token_ids: Iterable[int],
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        worker_id: str = "w0",
        step_time: Callable[[StepPlan], float] | None = None,
    ) -> None:
        """``vocab_ids``: the token ids the simulator may generate (the model's ordinary
        tokens); ``eos_token_ids``: the model's, for requests that do not give their own."""
        self.vocab = sorted(set(vocab_ids))
        if not self.vocab:
            raise ValueError("the simulator needs at least one token id to generate")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.worker_id = worker_id
        self.step_time = step_time or (lambda _plan: 0.0)
        # one layer, one head of one int64: K holds the token id, V the position
        k = torch.full((num_blocks, block_size, 1, 1), -1, dtype=torch.int64)
        v = torch.full((num_blocks, block_size, 1, 1), -1, dtype=torch.int64)
        self.kv_caches = [(k, v)]
        self._k = k.numpy().reshape(-1)
        self._v = v.numpy().reshape(-1)
        self.requests: dict[str, SimRequest] = {}
        self.tables = BlockTables(num_blocks)  # each request's (plans send differences)
        self.loras = None  # no weights: requests with an adapter run as without one
        self.total_computed_tokens = 0
        log.info(
            "simulated worker: %d KV blocks x %d tokens, max_model_len %d, %d token ids",
            num_blocks,
            block_size,
            max_model_len,
            len(self.vocab),
        )

    def reset(self) -> None:
        self.requests.clear()
        self.tables.clear()

    def _add_request(self, r: NewRequest) -> None:
        p = r.params
        if p.temperature < GREEDY_EPS:
            salt = 0
        elif p.seed is not None:
            salt = int(p.seed) + 1
        else:
            salt = zlib.crc32(r.request_id.encode()) + 1
        self.requests[r.request_id] = SimRequest(
            params=p,
            prompt_len=r.prompt_len,
            num_output_tokens=r.num_output_tokens,
            eos_token_ids=frozenset(r.eos_token_ids) or self.eos_token_ids,
            stop_token_ids=frozenset(p.stop_token_ids),
            salt=salt,
            embedding=r.pooling is not None,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; never raises (errors come back in ``StepResult.error``)."""
        t0 = time.perf_counter()
        out, err = None, None
        try:
            out = self._execute(plan)
        except Exception as e:  # noqa: BLE001 - the worker loop must survive a bad step
            log.exception("step %d failed", plan.step_id)
            err = f"{type(e).__name__}: {e}"
        model_s = self.step_time(plan) if plan.seqs and err is None else 0.0
        if model_s > 0:
            time.sleep(model_s)
        return step_result(self.worker_id, plan, out, time.perf_counter() - t0, err)

    def forget_lora(self, name: str) -> None:
        pass  # no weights, no adapters held

    def kv_shards(self) -> list[Any] | None:
        return None

    def weight_bytes(self) -> int:
        return 0

    def take_expert_load(self) -> list[int] | None:
        return None

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _execute(self, plan: StepPlan) -> StepOut:
        self.tables.apply(plan)
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        for r in plan.new_requests:
            self._add_request(r)
        out = StepOut()
        rows_of_plan = speculation.expand(plan.seqs)  # plan.seqs itself when nothing has drafts
        sampled, written = self._write_chunks(rows_of_plan)
        states = [self.requests[s.request_id] for s in sampled]
        tokens = self._next_tokens(sampled, [st.salt for st in states])
        if rows_of_plan is plan.seqs:  # one row per sampled chunk, in the plan's order
            for s, st, tok in zip(sampled, states, tokens, strict=True):
                self._emit(out, s, st, [tok])
        else:
            rows: dict[str, list[int]] = {}  # each request's sampled rows' tokens, in order
            for s, tok in zip(sampled, tokens, strict=True):
                rows.setdefault(s.request_id, []).append(tok)
            for s in plan.seqs:
                got = rows.get(s.request_id)
                if got is not None:
                    self._emit(out, s, self.requests[s.request_id], got)
        self.total_computed_tokens += written
        out.num_computed = written
        return out

    def _emit(self, out: StepOut, s: ScheduledSeq, st: SimRequest, got: list[int]) -> None:
        """Chunk ``s``'s outcome from the tokens sampled after its rows: the tokens it keeps
        (up to the one that ends the request), or an embedding request's vector."""
        if st.embedding:  # a vector from the same context hash: no token
            rng = np.random.default_rng(got[0])
            v = torch.from_numpy(rng.standard_normal(SIM_EMBEDDING_DIM))
            out.embeddings.append(pooled_output(s.request_id, v / v.norm()))
            return
        for tok in speculation.kept(s, got):
            reason = self._finish(st, tok)
            lp = None
            if st.params.logprobs is not None:
                k_top = min(int(st.params.logprobs), 1)
                lp = SampleLogprobs(0.0, [tok] * k_top, [0.0] * k_top)
            out.add(s.request_id, tok, int(reason), st.num_output_tokens, lp)
            if reason != FinishReason.NONE:
                break

    def _finish(self, st: SimRequest, tok: int) -> FinishReason:
        """Count the token and say whether the request ends with it (as the model runner)."""
        st.num_output_tokens += 1
        if st.params.structured_output is not None:  # no logits to mask
            return FinishReason.ERROR
        return finish_rule(
            st.params,
            tok,
            st.num_output_tokens,
            st.prompt_len,
            st.stop_token_ids,
            st.eos_token_ids,
            self.max_model_len,
        )

    def _write_chunks(self, seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], int]:
        """Check each chunk's block table length (its block ids were checked as they arrived,
        in ``BlockTables.apply``) and write its tokens (K) and positions (V) into the cache;
        returns the chunks to sample and the number of tokens written."""
        bs = self.block_size
        write_slots: list[int] = []
        write_tokens: list[int] = []
        write_pos: list[int] = []
        sampled = []
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"{s.request_id}: empty chunk")
            start = s.start_pos
            end = start + n
            table = s.block_table
            if len(table) * bs < end:
                raise ValueError(f"{s.request_id}: bad block table for {end} tokens: {table}")
            if s.sample and s.request_id not in self.requests:
                raise KeyError(f"{s.request_id}: unknown request (no NewRequest)")
            if n == 1:
                write_slots.append(table[start // bs] * bs + start % bs)
            else:
                used = table[: -(-end // bs)]
                pos = np.arange(start, end)
                write_slots.extend((np.asarray(used)[pos // bs] * bs + pos % bs).tolist())
            write_tokens.extend(s.token_ids)
            write_pos.extend(range(start, end))
            if s.sample:
                sampled.append(s)
        if write_slots:
            slots = np.asarray(write_slots, dtype=np.int64)
            self._k[slots] = write_tokens
            self._v[slots] = write_pos
        return sampled, len(write_tokens)

    def _next_tokens(self, seqs: list[ScheduledSeq], salts: list[int]) -> list[int]:
        """Each chunk's next token: a hash of the last two tokens in the cache (read back through
        its block table; -1 before position 0), its length and its request's salt. The cache is
        read once for the whole step."""
        bs, n = self.block_size, len(seqs)
        ends = [s.start_pos + len(s.token_ids) for s in seqs]
        slots = []  # each chunk's last two positions' slots (-1: none before position 0)
        for s, end in zip(seqs, ends, strict=True):
            table = s.block_table
            p1, p2 = end - 1, end - 2
            slots.append(table[p1 // bs] * bs + p1 % bs)
            slots.append(table[p2 // bs] * bs + p2 % bs if p2 >= 0 else -1)
        at = np.asarray(slots, dtype=np.int64)
        read = np.where(at >= 0, self._k[np.maximum(at, 0)], -1).tolist()
        vocab, size = self.vocab, len(self.vocab)
        return [
            vocab[hash((read[2 * i], read[2 * i + 1], ends[i], salts[i])) % size] for i in range(n)
        ]


def vocab_for(src: ModelSource) -> tuple[list[int], list[int]]:
    """(ordinary token ids, EOS ids) of a model, from its tokenizer and config: the simulator
    generates only tokens that are neither special nor added."""
    from kvflow.services.worker import machine
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import load_tokenizer

    cfg = load_config(src)
    tok = load_tokenizer(src, machine.cache_dir())
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder) | set(cfg.eos_token_ids)
    if cfg.bos_token_id is not None:
        special.add(cfg.bos_token_id)
    size = min(cfg.vocab_size, len(tok))
    return [i for i in range(size) if i not in special], list(cfg.eos_token_ids)
