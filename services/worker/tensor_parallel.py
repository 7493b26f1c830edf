"""Tensor parallelism of one decoder (any native family) over several ranks (Megatron-style), the model half: which part
of each weight a rank holds (``tp_layout``, ``shard_weights``) and the collectives the forward
pass needs (``TPGroup``: sum partial outputs, gather vocabulary slices) over torch.distributed
(gloo on CPU, NCCL on CUDA).

Per layer: Q/K/V and gate/up are column-parallel (a rank computes its heads and its slice of the
intermediate features), O and down are row-parallel (a rank's partial sums, all-reduced). The
embedding and the LM head are vocabulary-parallel (a rank looks up / scores its slice of the
vocabulary: the lookups are all-reduced, the logits gathered). Norms and the residual stream are
replicated.

Heads are split as evenly as the count allows (SmolLM2's 9 over 2 ranks: 5 and 4). A rank's
query heads must map uniformly onto its KV heads for the attention kernels (local head ``i``
uses local KV head ``i // (H_local / Hkv_local)``): when the rank's heads cover whole GQA groups
it keeps those KV heads (SmolLM2 over 3 ranks: 3 heads and 1 KV head each), otherwise it holds a
copy of the KV head of each of its query heads (replicated KV heads, as vLLM replicates them when
there are fewer KV heads than ranks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvflow.services.worker.lora_weights import module_shapes
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.registry import family

if TYPE_CHECKING:
    from kvflow.services.worker.tp_shm import ShmComm


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``world`` holds: query heads ``heads`` (global indices), for each
    of its KV heads the global KV head it copies (``kv_heads``), its slice of the MLP's
    intermediate features and of the vocabulary."""

    rank: int
    world: int
    heads: range
    kv_heads: tuple[int, ...]
    inter: range
    vocab: range
    moe_inter: range = range(0)  # of each routed expert's intermediate features (MoE)
    shared_inter: range = range(0)  # of the shared expert's (Qwen2-MoE)


def _split(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` items, the first ``n % world`` ranks one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def tp_layout(cfg: ModelConfig, rank: int, world: int) -> TPLayout:
    """Rank ``rank``'s share of ``cfg``'s model over ``world`` ranks; ValueError when some rank
    would get no query head."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    refused = family(cfg.family).refusal(tensor_parallel=world > 1)
    if refused:
        raise ValueError(refused)
    if cfg.num_experts and world > cfg.moe_intermediate_size:
        raise ValueError(
            f"--tensor-parallel-size {world} is more than the experts' "
            f"{cfg.moe_intermediate_size} intermediate features"
        )
    if world > cfg.num_heads:
        raise ValueError(
            f"--tensor-parallel-size {world} is more than the model's {cfg.num_heads} heads"
        )
    heads = _split(cfg.num_heads, world, rank)
    group = cfg.num_heads // cfg.num_kv_heads
    needed = [h // group for h in heads]
    kv = sorted(set(needed))
    per = len(heads) // len(kv) if len(heads) % len(kv) == 0 else 0
    uniform = per > 0 and all(needed[i] == kv[i // per] for i in range(len(heads)))
    kv_heads = tuple(kv) if uniform else tuple(needed)
    return TPLayout(
        rank,
        world,
        heads,
        kv_heads,
        _split(cfg.intermediate_size, world, rank),
        _split(cfg.vocab_size, world, rank),
        _split(cfg.moe_intermediate_size, world, rank),
        _split(cfg.shared_expert_size, world, rank),
    )


def shard_config(cfg: ModelConfig, layout: TPLayout) -> ModelConfig:
    """The model a rank runs: its heads, KV heads and intermediate features (vocabulary and
    hidden size unchanged: the embedding and head shards are handled by ``TPGroup``)."""
    return dataclasses.replace(
        cfg,
        num_heads=len(layout.heads),
        num_kv_heads=len(layout.kv_heads),
        intermediate_size=len(layout.inter),
        moe_intermediate_size=len(layout.moe_inter),
        shared_expert_size=len(layout.shared_inter),
    )


def _features(cfg: ModelConfig, layout: TPLayout) -> tuple[torch.Tensor, ...]:
    """The rank's query features, KV features (copies included) and intermediate features."""
    d = cfg.head_dim
    q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in layout.heads])
    kv_rows = torch.cat([torch.arange(k * d, (k + 1) * d) for k in layout.kv_heads])
    return q_rows, kv_rows, torch.arange(layout.inter.start, layout.inter.stop)


def shard_weights(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, layout: TPLayout
) -> dict[str, torch.Tensor]:
    """Rank ``layout.rank``'s part of HF-named dense weights (a new dict): column-parallel
    projections (q/k/v, gate/up) and their biases cut by output rows, row-parallel ones (o,
    down) by input columns (their biases whole: they are added once, after the sum), the
    embedding and LM head cut to the rank's vocabulary rows; norms (q/k norms per head
    included) replicated. A mixture of experts: every routed expert and the shared expert cut
    as an MLP is, each by its own intermediate features (one all-reduce per MoE layer, as
    vLLM's default); the router and the shared expert's gate replicated (every rank routes
    the same)."""
    q_rows, kv_rows, inter = _features(cfg, layout)
    mlp_rows = {  # the intermediate features of each kind of MLP a layer may have
        "experts": torch.arange(layout.moe_inter.start, layout.moe_inter.stop),
        "shared_expert": torch.arange(layout.shared_inter.start, layout.shared_inter.stop),
        "mlp": inter,
    }
    vocab = slice(layout.vocab.start, layout.vocab.stop)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}: tensor parallelism takes dense weights (no --quantization)")
        module, _, kind = name.rpartition(".")
        proj = module.rsplit(".", 1)[-1]
        owner = next((k for k in ("experts", "shared_expert") if f".{k}." in name), "mlp")
        inter = mlp_rows[owner]
        if proj == "q_proj":
            out[name] = w[q_rows].contiguous()
        elif proj in ("k_proj", "v_proj"):
            out[name] = w[kv_rows].contiguous()
        elif proj in ("gate_proj", "up_proj"):
            out[name] = w[inter].contiguous()
        elif proj == "o_proj":
            out[name] = w[:, q_rows].contiguous() if kind == "weight" else w
        elif proj == "down_proj":
            out[name] = w[:, inter].contiguous() if kind == "weight" else w
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = w[vocab].contiguous()
        else:  # norms: replicated
            out[name] = w
    if "lm_head.weight" not in weights:  # tied: the head is the embedding's slice
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


class LoRAShard:
    """A rank's part of every LoRA adapter (services/worker/lora_weights.py): an adapter is
    checked against the whole model (``full``), then each pair is cut as the rank's weights
    are: B's rows for the column-parallel projections (q, k, v with the rank's KV copies,
    gate, up), A's columns for the row-parallel ones (o, down), whose LoRA output is a partial
    sum added before the all-reduce. PEFT's scale is already in B."""

    def __init__(self, full: ModelConfig, layout: TPLayout) -> None:
        self.full = full
        self.shapes = module_shapes(shard_config(full, layout))  # (in, out) on this rank
        self._q, self._kv, self._inter = _features(full, layout)

    def cut(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(A [r, in], B [out, r]) of ``module`` -> this rank's (A, B)."""
        if module == "q_proj":
            return a, b[self._q]
        if module in ("k_proj", "v_proj"):
            return a, b[self._kv]
        if module in ("gate_proj", "up_proj"):
            return a, b[self._inter]
        if module == "o_proj":
            return a[:, self._q], b
        return a[:, self._inter], b  # down_proj


class TPGroup:
    """The collectives of one rank's forward pass: over ``comm`` (services/worker/tp_shm.py,
    the ranks' shared memory) where given and the tensor fits, else over torch.distributed's
    default group (gloo on CPU, NCCL on CUDA). The choice depends only on shapes, which every
    rank has alike, so all ranks take the same way."""

    def __init__(self, layout: TPLayout, comm: ShmComm | None = None) -> None:
        self.layout = layout
        self.comm = comm
        # a collective raised (a rank died or timed out): the ranks are out of step for good,
        # and the group must go down (tp_group.py) rather than step on
        self.broken = False

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the ranks, in place."""
        try:
            if self.comm is not None and self.comm.fits(partial):
                return self.comm.all_reduce(partial)
            torch.distributed.all_reduce(partial)
        except BaseException:
            self.broken = True
            raise
        return partial

    def embed(self, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank its own rows (zeros elsewhere), summed."""
        v = self.layout.vocab
        mine = (ids >= v.start) & (ids < v.stop)
        local = torch.where(mine, ids - v.start, torch.zeros_like(ids))
        h = shard[local] * mine.unsqueeze(-1).to(shard.dtype)
        return self.reduce(h)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits slice [S, V_rank] joined into [S, vocab] (on every rank)."""
        world = self.layout.world
        sizes = [len(_split(vocab_size, world, r)) for r in range(world)]
        width = max(sizes)  # all_gather takes equal shapes: the shorter slices are padded
        mine = local
        if local.shape[1] < width:
            mine = torch.cat([local, local.new_zeros(local.shape[0], width - local.shape[1])], 1)
        mine = mine.contiguous()
        try:
            if self.comm is not None and self.comm.fits(mine):
                parts = self.comm.all_gather(mine)
            else:
                parts = [local.new_empty(local.shape[0], width) for _ in sizes]
                torch.distributed.all_gather(parts, mine)
        except BaseException:
            self.broken = True
            raise
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)
