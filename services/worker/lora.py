"""LoRA adapters in the worker: at most ``--max-loras`` held in memory, least recently used
evicted (``LoRACache``, by shared/lora_residency.py's rule, which the scheduler's view of this
worker follows too; their weights read and checked by services/worker/lora_weights.py), and
each step's rows given their adapter's delta ``s * B (A x)`` on top of the base projections
(``LoRAStep.apply``, called by ``DecoderModel`` after each linear layer).

Two ways to apply, as the model runs:

- CPU path: the step's adapters are fused side by side (``FusedAdapters``, kept for the next
  steps): one A per group (every adapter's, projection by projection) and one B per projection
  (its adapters' side by side, without the block-diagonal zeros), so a group takes one GEMM for
  A and one per projection for B over the rows that have an adapter, whatever their number, and
  a mask between them keeps each row's own adapter's rank columns. On a machine with the panel
  kernel (kernels/cpu_gemm.py) A and B are packed as panels, whose rows and columns do not
  depend on the others (and zeros add exactly), so a request's output is the same alone or
  batched with other adapters.
- Device path: the adapters in memory sit in slots of stacked tensors, and every row takes its
  slot's A and B in the kernel backend's ``lora_shrink``/``lora_expand`` (Triton on CUDA: a
  gathered GEMV per row, Punica's BGMV; -1 rows are left alone)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvflow.kernels.cpu_gemm import PanelWeight, panel_available
from kvflow.kernels.ops import KernelBackend
from kvflow.services.worker.lora_weights import GROUPS, LoRAWeights, load_adapter, module_shapes
from kvflow.shared.lora import LoRAError
from kvflow.shared.lora_residency import LoraResidency
from kvflow.shared.messages import LoRARef, ScheduledSeq
from kvflow.shared.models.config import ModelConfig

if TYPE_CHECKING:
    from kvflow.services.worker.tensor_parallel import LoRAShard

log = logging.getLogger("kvflow.worker")

MatMul = Callable[[torch.Tensor], torch.Tensor]
FUSED_SETS = 8  # sets of adapters kept fused on the CPU path (steps reuse the same few)


@dataclass(frozen=True)
class LoRASpec:
    """A worker's LoRA settings (``--enable-lora``): adapters held at most, highest rank."""

    max_loras: int = 1
    max_rank: int = 16
    shard: LoRAShard | None = None  # a tensor-parallel rank's part of each adapter


def _matmul(t: torch.Tensor, panels: bool) -> MatMul:
    """``x -> x @ t.T``: a panel weight (batch invariant) where the kernel runs, else dense."""
    if panels:
        return PanelWeight(t.contiguous())
    return lambda x: torch.nn.functional.linear(x, t)


@dataclass
class _Side:
    """Several adapters' pairs of one group in one layer, for the CPU path. ``a``: every A
    stacked projection by projection (within one, adapter by adapter), so each projection's
    rank columns are one range of ``a``'s output; ``parts``: per projection, its output columns
    (o0, o1), its rank columns (c0, c1) and its adapters' B side by side; ``runs``: the owner
    (index in the set) of ``a``'s output columns, run-length encoded."""

    a: MatMul
    parts: tuple[tuple[int, int, int, int, MatMul], ...]
    runs: tuple[tuple[int, int], ...]


def _side(have: list[tuple[int, LoRAWeights]], layer: int, group: str, panels: bool) -> _Side:
    """``have`` (index in the set, adapter) fused for ``group`` of ``layer``: no block-diagonal
    zeros, so each B reads only its own projection's weights."""
    a_rows: list[torch.Tensor] = []
    parts: list[tuple[int, int, int, int, MatMul]] = []
    owner: list[int] = []
    o0 = 0
    for mi in range(len(GROUPS[group])):
        c0, bs = len(owner), []
        n = have[0][1].blocks[layer][group][mi][1]
        for k, w in have:
            a, b = w.layers[layer][group]
            sizes = w.blocks[layer][group]
            r = sizes[mi][0]
            if r:
                r0 = sum(x[0] for x in sizes[:mi])
                a_rows.append(a[r0 : r0 + r])
                bs.append(b[o0 : o0 + n, r0 : r0 + r])
                owner += [k] * r
        if bs:
            parts.append((o0, o0 + n, c0, len(owner), _matmul(torch.cat(bs, dim=1), panels)))
        o0 += n
    runs: list[tuple[int, int]] = []
    for k in owner:
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1] + 1)
        else:
            runs.append((k, 1))
    return _Side(_matmul(torch.cat(a_rows), panels), tuple(parts), tuple(runs))


class FusedAdapters:
    """A set of adapters as one A per layer and group and one B per projection, for the CPU
    path: a step with several adapters runs the same few GEMMs per projection whatever their
    number, each row keeping its own adapter's rank columns (a mask) between A and B. With
    panel weights a row's columns and sums do not depend on the other adapters or rows (zeros
    add exactly), so a request's output is the same alone or batched with other adapters."""

    def __init__(self, weights: list[LoRAWeights]) -> None:
        self.names = tuple(w.ref.name for w in weights)
        panels = panel_available() and all(
            a.dtype == torch.float32 and a.device.type == "cpu"
            for w in weights
            for layer in w.layers
            for a, _ in layer.values()
        )
        self.layers: list[dict[str, _Side]] = []
        for i in range(len(weights[0].layers)):
            layer: dict[str, _Side] = {}
            for group in GROUPS:
                have = [(k, w) for k, w in enumerate(weights) if group in w.layers[i]]
                if have:
                    layer[group] = _side(have, i, group, panels)
            self.layers.append(layer)


class LoRAStep:
    """Which rows of one step run which adapter, and how to add their deltas."""

    def __init__(
        self,
        fused: FusedAdapters | None = None,
        rows: torch.Tensor | slice | None = None,
        owner: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        stacks: LoRAStacks | None = None,
        ops: KernelBackend | None = None,
    ) -> None:
        # CPU path: the step's adapters fused, the rows that have one (a slice when they are
        # contiguous) and each such row's adapter (its index in ``fused``)
        self.fused, self.rows, self.owner = fused, rows, owner
        self.slots, self.stacks, self.ops = slots, stacks, ops  # device path
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += B (A x[rows])`` for each row's adapter, in place."""
        if self.stacks is not None:
            assert self.ops is not None and self.slots is not None
            a, b = self.stacks.pair(layer, group)
            self.ops.lora_expand(self.ops.lora_shrink(x, a, self.slots), b, self.slots, out)
            return
        assert self.fused is not None and self.rows is not None
        side = self.fused.layers[layer].get(group)
        if side is None:
            return
        xa = side.a(x[self.rows])
        if len(self.fused.names) > 1:
            xa.mul_(self._mask(side.runs))
        for o0, o1, c0, c1, b in side.parts:
            delta = b(xa[:, c0:c1])
            if isinstance(self.rows, slice):
                out[self.rows, o0:o1] += delta
            else:
                out[:, o0:o1].index_add_(0, self.rows, delta)

    def _mask(self, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """[rows, columns]: 1 where the column is the row's own adapter's."""
        m = self._masks.get(runs)
        if m is None:
            assert self.owner is not None
            cols = torch.cat([torch.full((r,), k, dtype=torch.long) for k, r in runs])
            m = self._masks[runs] = (self.owner[:, None] == cols[None, :]).float()
        return m


class LoRAStacks:
    """The device path's adapter slots: per layer and group, A [S, R, in] and B [S, out, R]
    (R: ``max_rank`` times the group's projections; zero where an adapter has less)."""

    def __init__(
        self, cfg: ModelConfig, slots: int, max_rank: int, dtype: torch.dtype, device: Any
    ) -> None:
        shapes = module_shapes(cfg)
        self.tensors: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(cfg.num_layers):
            layer = {}
            for group, modules in GROUPS.items():
                n_in, n_out = shapes[modules[0]][0], sum(shapes[m][1] for m in modules)
                r = max_rank * len(modules)
                a = torch.zeros(slots, r, n_in, dtype=dtype, device=device)
                layer[group] = (a, torch.zeros(slots, n_out, r, dtype=dtype, device=device))
            self.tensors.append(layer)

    def pair(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[layer][group]

    def put(self, slot: int, w: LoRAWeights) -> None:
        """Copy adapter ``w`` into ``slot`` (zeros where it adapts nothing)."""
        for layer, mine in zip(self.tensors, w.layers, strict=True):
            for group, (a, b) in layer.items():
                a[slot].zero_()
                b[slot].zero_()
                if group in mine:
                    wa, wb = mine[group]
                    a[slot, : wa.shape[0]] = wa
                    b[slot, :, : wb.shape[1]] = wb


class LoRACache:
    """The adapters a worker holds: at most ``max_loras``, least recently used evicted (a step
    that needs more keeps them all until it ends: the scheduler does not plan such steps). Which
    are held, in which order, is ``residency``'s; ``loaded`` has their weights."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ops: KernelBackend | None = None,
        shard: LoRAShard | None = None,
    ) -> None:
        """``cfg``: the model as this worker (rank) holds it; ``shard``: how a tensor-parallel
        rank cuts each adapter (checked against ``shard.full``)."""
        self.cfg, self.max_loras, self.max_rank = cfg, max(1, max_loras), max_rank
        self.shard = shard
        self.check_cfg = shard.full if shard is not None else cfg
        self.dtype, self.device, self.ops = dtype, torch.device(device), ops
        self.residency = LoraResidency(self.max_loras)
        self.loaded: dict[str, LoRAWeights] = {}  # the weights of the adapters ``residency`` holds
        self.slot_of: dict[str, int] = {}  # device path: the stack slot of each loaded adapter
        self.stacks: LoRAStacks | None = None
        # CPU path: the sets of adapters recent steps ran, fused (most recent last)
        self.fused: OrderedDict[tuple[str, ...], FusedAdapters] = OrderedDict()
        self.loads = 0  # adapters read from disk so far (misses)

    def check(self, ref: LoRARef) -> None:
        """Read and check ``ref`` without keeping it; raises LoRAError."""
        load_adapter(ref, self.check_cfg, self.max_rank, self.dtype, "cpu", self.shard)

    def forget(self, name: str) -> None:
        self.residency.forget(name)
        self._drop(name)

    def _drop(self, name: str) -> None:
        """Let go of ``name``'s weights (its slot, the fused sets that have it)."""
        self.loaded.pop(name, None)
        self.slot_of.pop(name, None)
        for names in [k for k in self.fused if name in k]:
            del self.fused[names]

    def get(self, ref: LoRARef, keep: set[str]) -> LoRAWeights:
        """``ref``'s weights, loaded (and another evicted, never one in ``keep``) if needed."""
        have = self.loaded.get(ref.name)
        if have is not None and have.ref == ref:
            self.residency.use(ref.name, keep)
            return have
        w = load_adapter(ref, self.check_cfg, self.max_rank, self.dtype, self.device, self.shard)
        self.loads += 1
        self.forget(ref.name)
        for old in self.residency.use(ref.name, keep):
            self._drop(old)
        self.loaded[ref.name] = w
        if self.ops is not None:
            self._place(w)
        return w

    def _place(self, w: LoRAWeights) -> None:
        if self.stacks is None:
            self.stacks = LoRAStacks(
                self.cfg, self.max_loras, self.max_rank, self.dtype, self.device
            )
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            raise LoRAError(f"a step needs more than --max-loras {self.max_loras} adapters")
        self.slot_of[w.ref.name] = free[0]
        self.stacks.put(free[0], w)

    def step(
        self, seqs: Sequence[ScheduledSeq], adapters: Mapping[str, LoRARef | None]
    ) -> tuple[LoRAStep | None, dict[str, str]]:
        """The LoRA rows of a step laid out as ``seqs`` (rows in order, ``len(token_ids)``
        each); ``adapters`` maps request ids to theirs. None when no row has one. Also the
        adapters that could not be loaded (name -> why): their rows run without them, and the
        runner ends their requests in ERROR."""
        rows: dict[str, list[int]] = {}
        refs: dict[str, LoRARef] = {}
        at = 0
        for s in seqs:
            ref = adapters.get(s.request_id)
            n = len(s.token_ids)
            if ref is not None:
                rows.setdefault(ref.name, []).extend(range(at, at + n))
                refs[ref.name] = ref
            at += n
        keep = set(rows)
        weights: dict[str, LoRAWeights] = {}
        failed: dict[str, str] = {}
        for name in list(rows):
            try:
                weights[name] = self.get(refs[name], keep)
            except LoRAError as e:  # e.g. its files went away since it was checked
                log.error("LoRA adapter %s cannot be loaded: %s", name, e)
                failed[name] = str(e)
                del rows[name]
        if not rows:
            return None, failed
        return self._step(rows, weights, at), failed

    def _step(
        self, rows: dict[str, list[int]], weights: dict[str, LoRAWeights], at: int
    ) -> LoRAStep:
        """The step's rows (``rows``: adapter -> its row indices, of ``at`` rows in all) as
        slot indices (device path) or fused adapters and their rows (CPU path)."""
        if self.ops is not None:
            slots = torch.full((at,), -1, dtype=torch.int32)
            for name, r in rows.items():
                slots[torch.tensor(r)] = self.slot_of[name]
            return LoRAStep(slots=slots.to(self.device), stacks=self.stacks, ops=self.ops)
        names = tuple(sorted(rows))
        fused = self._fused(names, [weights[n] for n in names])
        owner = torch.full((at,), -1, dtype=torch.long)
        for k, name in enumerate(names):
            owner[torch.tensor(rows[name])] = k
        picked = (owner >= 0).nonzero().flatten()
        first, last = int(picked[0]), int(picked[-1])
        if last - first + 1 == len(picked):  # contiguous rows: a view, no gather
            return LoRAStep(fused, slice(first, last + 1), owner[first : last + 1])
        return LoRAStep(fused, picked, owner[picked])

    def _fused(self, names: tuple[str, ...], weights: list[LoRAWeights]) -> FusedAdapters:
        """The adapters ``names`` fused (kept for the next steps: a few sets, LRU)."""
        got = self.fused.get(names)
        if got is None:
            got = self.fused[names] = FusedAdapters(weights)
            while len(self.fused) > FUSED_SETS:
                self.fused.popitem(last=False)
        self.fused.move_to_end(names)
        return got


def lora_rows(
    cache: LoRACache | None, seqs: Sequence[ScheduledSeq], requests: Mapping[str, Any]
) -> LoRAStep | None:
    """The adapters of a step's rows (None: no row has one); ``requests`` maps request ids to
    the runner's RequestState. An adapter that cannot be loaded now ends its requests in ERROR
    (``lora_failed``), not the step."""
    if cache is None:
        return None
    adapters = {s.request_id: st.lora for s in seqs if (st := requests.get(s.request_id))}
    lora, failed = cache.step(seqs, adapters)
    for s in seqs:
        st = requests.get(s.request_id)
        if st is not None and st.lora is not None and st.lora.name in failed:
            st.lora_failed = True
    return lora
