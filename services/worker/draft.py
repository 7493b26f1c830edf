"""Speculative decoding with a draft model: a smaller Llama with the target's vocabulary that
lives in the worker beside the target, with a paged KV cache of its own laid out like the
target's (the same block ids and block size), so the scheduler's block tables serve both and
its bookkeeping (preemption, prefix caching, freed drafts) covers the draft's cache too.

For each sequence the scheduler asks drafts of (``ScheduledSeq.num_propose``), the draft model
first runs every known token of it that it has not run yet (the prompt, then whatever was
decoded while the sequence was not speculating), then proposes greedily one position at a
time, all such sequences batched per position. A sequence that does not speculate (backed off
after misses, or never: penalties, grammars) costs the draft nothing. The drafts are appended to the
chunk (``num_draft``) and verified by the target exactly as n-gram drafts are
(services/worker/speculation.py): a greedy draft is a one-hot proposal, so output keeps the
target's distribution.

The draft's cache is written for the known tokens and drafts 1..k-1; when all k drafts are
accepted the k-th has no draft K/V yet, so it waits with the next known tokens. K/V that reaches
the worker another way (a prefix-cache hit on blocks whose draft K/V was never computed, a
prefill worker, a KV tier) is target K/V only: the draft then proposes from a cache with holes,
which costs acceptance, never correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.model_loader import load_weights
from kvflow.services.worker.model_setup import CpuPathSpec, DeviceSpec, LoadedModel, load_model
from kvflow.services.worker.step_inputs import HostStep, Staging, pack
from kvflow.services.worker.step_rows import StepRows, host_batch, lay_out
from kvflow.shared.messages import ScheduledSeq
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import resolve_model
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.speculative import SpeculativeConfig

log = logging.getLogger("kvflow.worker")


@dataclass
class _Bare:
    """What ``lay_out`` reads of a request's state, for the draft's rows (nothing to replay,
    no prompt logprobs, no pooling)."""

    guide: None = None
    pool: None = None
    prompt_logprobs_k: None = None


_BARE = _Bare()


def load_draft(cfg: SpeculativeConfig, device: DeviceSpec, target: ModelConfig) -> LoadedModel:
    """The draft model ``cfg`` names, on the target's device and dtype (its first
    ``num_draft_layers`` layers when set); ValueError when its vocabulary is not the
    target's."""
    src = resolve_model(cfg.model)
    full = load_config(src)
    config = full
    if cfg.num_draft_layers:
        config = replace(full, num_layers=min(cfg.num_draft_layers, full.num_layers))
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {src.name} has a vocabulary of {config.vocab_size} tokens, the served "
            f"model {target.vocab_size}: a draft must share the served model's tokenizer"
        )
    log.info("loading draft model %s (%d layers) from %s", src.name, config.num_layers, src.path)
    quant = (
        device.quantization if device.quantization in ("gguf", "gguf-a8", "int8", "w8a8") else ""
    )
    weights = load_weights(src, full, device.dtype, quant)  # the model keeps its first layers
    spec = replace(device, quantization="")
    return load_model(None, spec, CpuPathSpec(batch_invariant=False), config, weights)


class DraftProposer:
    """A draft model and its KV cache (``num_blocks`` x ``block_size``, the target's), read
    through the target runner's block ``tables``."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, tables: BlockTables
    ) -> None:
        self.loaded = loaded
        self.tables = tables
        self.model = loaded.model
        self.block_size = block_size
        self.kv_caches = self.model.make_kv_caches(num_blocks, block_size)
        self.staging = Staging(loaded.device)  # its own: the target's is in use meanwhile
        # request id -> (position, tokens): known tokens the target has computed and the draft
        # not yet, contiguous from that position; run in front of the request's next proposal
        self.pending: dict[str, tuple[int, list[int]]] = {}

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def step(self, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Return ``seqs`` with the drafts of each sequence that asks for them appended
        (``num_draft`` set); the draft runs only for those, over every known token it has
        not run yet (so a sequence that is not speculating costs the draft nothing)."""
        for s in seqs:
            self._remember(s)
        proposing = [s for s in seqs if s.num_propose > 0]
        catch_up = []
        for s in proposing:
            start, toks = self.pending.pop(s.request_id)
            catch_up.append(ScheduledSeq(s.request_id, toks, start, s.block_table))
        drafts = {s.request_id: [t] for s, t in zip(proposing, self._run(catch_up), strict=True)}
        for n in range(1, max((s.num_propose for s in proposing), default=0)):
            more = [s for s in proposing if s.num_propose > n]
            step = [
                ScheduledSeq(
                    s.request_id,
                    [drafts[s.request_id][-1]],
                    s.start_pos + len(s.token_ids) + n - 1,
                    s.block_table,
                )
                for s in more
            ]
            for s, t in zip(more, self._run(step), strict=True):
                drafts[s.request_id].append(t)
        out = []
        for s in seqs:
            d = drafts.get(s.request_id)
            if d is None:
                out.append(s)
                continue
            out.append(
                ScheduledSeq(
                    s.request_id,
                    s.token_ids + d,
                    s.start_pos,
                    s.block_table,
                    s.sample,
                    num_draft=len(d),
                )
            )
        return out

    def verified(self, s: ScheduledSeq, picked: list[int]) -> None:
        """The target kept ``picked`` for ``s`` (a chunk with drafts; the draft ran its known
        tokens and drafts 1..k-1): when every draft was accepted, the last one has no draft
        K/V yet and waits for the next proposal."""
        k = s.num_draft
        if k and len(picked) == k + 1:
            self.pending[s.request_id] = (s.start_pos + len(s.token_ids) - 1, [s.token_ids[-1]])

    def _remember(self, s: ScheduledSeq) -> None:
        """Add a chunk's known tokens to what the draft has to run: after what is pending when
        it follows on, else instead of it (a recompute, or K/V the draft never saw)."""
        known = s.token_ids[: len(s.token_ids) - s.num_draft]
        got = self.pending.get(s.request_id)
        if got is not None and got[0] + len(got[1]) == s.start_pos:
            got[1].extend(known)
        else:
            self.pending[s.request_id] = (s.start_pos, list(known))

    def _run(self, seqs: list[ScheduledSeq]) -> list[int]:
        """One draft forward over ``seqs`` (each sampled); the greedy token after each."""
        if not seqs:
            return []
        step = lay_out(
            seqs,
            {s.request_id: _BARE for s in seqs},
            self.block_size,
            self.model.cfg.max_position_embeddings,
        )
        logits = self._forward(step)
        order = [s.request_id for s in step.seqs]  # lay_out's order
        by_id = dict(zip(order, logits.argmax(dim=-1).tolist(), strict=True))
        return [by_id[s.request_id] for s in seqs]

    def _forward(self, step: StepRows) -> torch.Tensor:
        ld = self.loaded
        if ld.ops is None:
            batch = host_batch(step, self.tables, self.block_size, ld.decode_fn, ld.gemm_rows)
            ids, pos = torch.tensor(step.ids), torch.tensor(step.pos)
            return self.model(ids, pos, batch, self.kv_caches)
        bs = self.block_size
        ends = [s.start_pos + len(s.token_ids) for s in step.seqs]
        tables = self.tables.used(step.seqs, ends, bs)
        qlens = [len(s.token_ids) for s in step.seqs]
        host = HostStep(step.ids, step.pos, step.slots, tables, ends, qlens, step.logits_rows)
        batch = pack(host, self.staging)
        return self.model.forward_device_pooled(ld.ops, batch, self.kv_caches, None)[0]
