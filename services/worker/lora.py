"""LoRA adapters in the worker: PEFT weights read and checked against the model (``load_adapter``),
at most ``--max-loras`` held in memory, least recently used evicted (``LoRACache``), and each
step's rows given their adapter's delta ``s * B (A x)`` on top of the base projections
(``LoRAStep.apply``, called by ``LlamaModel`` after each linear layer).

Projections are fused as the model fuses them: one (A, B) pair per group, ``qkv`` (q, k and v:
A stacked by rows, B block-diagonal, so one pair of GEMMs gives all three deltas), ``o``,
``gate_up`` (gate and up, the same way) and ``down``; PEFT's scale is folded into B.

Two ways to apply, as the model runs:

- CPU path: rows are grouped by adapter and each group runs two small GEMMs. On a machine with
  the panel kernel (kernels/cpu_gemm.py) A and B are packed as panels, whose rows do not depend
  on the other rows of the GEMM, so a request's output is the same whatever else is batched.
- Device path: the adapters in memory sit in slots of stacked tensors, and every row takes its
  slot's A and B in the kernel backend's ``lora_shrink``/``lora_expand`` (Triton on CUDA: a
  gathered GEMV per row, Punica's BGMV; -1 rows are left alone)."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.cpu_gemm import PanelWeight, panel_available
from kernels.ops import KernelBackend
from shared.lora import ADAPTER_WEIGHTS, LoRAError, check_rank, read_adapter_config
from shared.messages import LoRARef, ScheduledSeq
from shared.model_loader import ModelConfig

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

MatMul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoRASpec:
    """A worker's LoRA settings (``--enable-lora``): adapters held at most, highest rank."""

    max_loras: int = 1
    max_rank: int = 16


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of a Llama layer."""
    q, kv, h, i = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        (cfg.intermediate_size),
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass
class LoRAWeights:
    """One adapter's fused pairs: ``layers[i][group] = (A [R, in], B [out, R])`` (B scaled);
    a group the adapter leaves alone is absent."""

    ref: LoRARef
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    # the CPU path's matmuls of the same pairs (panels where the kernel runs)
    matmuls: list[dict[str, tuple[MatMul, MatMul]]] = field(default_factory=list)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, bin_ = (path / w for w in ADAPTER_WEIGHTS)
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        return torch.load(str(bin_), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise LoRAError(f"{path}: the adapter's weights cannot be read: {e}", "lora_path") from e


def load_adapter(
    ref: LoRARef,
    cfg: ModelConfig,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoRAWeights:
    """Read ``ref``'s PEFT directory and check every tensor against the model ``cfg``; raises
    LoRAError naming what is wrong (and nothing is kept)."""
    conf = read_adapter_config(ref.path)
    tensors = _read_tensors(Path(ref.path))
    shapes = module_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in shapes:
            raise LoRAError(
                f"{ref.path}: tensor {key!r} adapts something other than the attention and "
                "MLP projections of a Llama layer (not served)",
                "lora_path",
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"{ref.path}: {key!r} is for layer {layer}; the model has {cfg.num_layers}",
                "lora_path",
            )
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise LoRAError(f"{ref.path}: the adapter holds no LoRA weights", "lora_path")
    rank = 0
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in found.items():
        a, b = ab.get("A"), ab.get("B")
        n_in, n_out = shapes[module]
        r = a.shape[0] if a is not None and a.dim() == 2 else -1
        if a is None or b is None or tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            got = {k: tuple(v.shape) for k, v in ab.items()}
            raise LoRAError(
                f"{ref.path}: layer {layer} {module}: lora_A/lora_B shapes {got} do not fit the "
                f"model (want A [r, {n_in}], B [{n_out}, r]): an adapter for another model?",
                "lora_path",
            )
        check_rank(r, max_rank, ref.name)
        rank = max(rank, r)
        scale = conf.scaling(r)
        pairs[(layer, module)] = (a.float(), b.float() * scale)
    layers = [_fuse(pairs, i, shapes, dtype, device) for i in range(cfg.num_layers)]
    return LoRAWeights(ref, rank, layers)


def _fuse(
    pairs: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    shapes: Mapping[str, tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``layer``'s pairs fused by group: A stacked, B block-diagonal."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for group, modules in GROUPS.items():
        if not any((layer, m) in pairs for m in modules):
            continue
        n_in = shapes[modules[0]][0]
        ranks = [pairs[(layer, m)][0].shape[0] if (layer, m) in pairs else 0 for m in modules]
        outs = [shapes[m][1] for m in modules]
        a = torch.zeros(sum(ranks), n_in)
        b = torch.zeros(sum(outs), sum(ranks))
        r0 = o0 = 0
        for m, r, n in zip(modules, ranks, outs, strict=True):
            if r:
                a[r0 : r0 + r] = pairs[(layer, m)][0]
                b[o0 : o0 + n, r0 : r0 + r] = pairs[(layer, m)][1]
            r0, o0 = r0 + r, o0 + n
        out[group] = (a.to(device, dtype), b.to(device, dtype))
    return out


def _pack(w: LoRAWeights) -> None:
    """The CPU path's matmuls: panels (batch invariant) where the kernel runs, else dense."""
    panels = panel_available() and all(
        a.dtype == torch.float32 and a.device.type == "cpu"
        for layer in w.layers
        for a, _ in layer.values()
    )

    def mm(t: torch.Tensor) -> MatMul:
        if panels:
            return PanelWeight(t.contiguous())
        return lambda x: torch.nn.functional.linear(x, t)

    w.matmuls = [{g: (mm(a), mm(b)) for g, (a, b) in layer.items()} for layer in w.layers]


class LoRAStep:
    """Which rows of one step run which adapter, and how to add their deltas."""

    def __init__(
        self,
        groups: list[tuple[LoRAWeights, torch.Tensor | slice]],
        slots: torch.Tensor | None = None,
        stacks: LoRAStacks | None = None,
        ops: KernelBackend | None = None,
    ) -> None:
        self.groups = groups  # CPU path: (adapter, its rows)
        self.slots, self.stacks, self.ops = slots, stacks, ops  # device path

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += B (A x[rows])`` for each row's adapter, in place."""
        if self.stacks is not None:
            assert self.ops is not None and self.slots is not None
            a, b = self.stacks.pair(layer, group)
            self.ops.lora_expand(self.ops.lora_shrink(x, a, self.slots), b, self.slots, out)
            return
        for w, rows in self.groups:
            mm = w.matmuls[layer].get(group)
            if mm is None:
                continue
            delta = mm[1](mm[0](x[rows]))
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)


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
    that needs more keeps them all until it ends: the scheduler does not plan such steps)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ops: KernelBackend | None = None,
    ) -> None:
        self.cfg, self.max_loras, self.max_rank = cfg, max(1, max_loras), max_rank
        self.dtype, self.device, self.ops = dtype, torch.device(device), ops
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.slot_of: dict[str, int] = {}  # device path: the stack slot of each loaded adapter
        self.stacks: LoRAStacks | None = None
        self.loads = 0  # adapters read from disk so far (misses)

    def check(self, ref: LoRARef) -> None:
        """Read and check ``ref`` without keeping it; raises LoRAError."""
        load_adapter(ref, self.cfg, self.max_rank, self.dtype, "cpu")

    def forget(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.slot_of.pop(name, None)

    def get(self, ref: LoRARef, keep: set[str]) -> LoRAWeights:
        """``ref``'s weights, loaded (and another evicted, never one in ``keep``) if needed."""
        have = self.loaded.get(ref.name)
        if have is not None and have.ref == ref:
            self.loaded.move_to_end(ref.name)
            return have
        w = load_adapter(ref, self.cfg, self.max_rank, self.dtype, self.device)
        self.loads += 1
        if self.ops is None:
            _pack(w)
        self.forget(ref.name)
        while len(self.loaded) >= self.max_loras:
            old = next((n for n in self.loaded if n not in keep), None)
            if old is None:
                break
            self.forget(old)
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
    ) -> LoRAStep | None:
        """The LoRA rows of a step laid out as ``seqs`` (rows in order, ``len(token_ids)``
        each); ``adapters`` maps request ids to theirs. None when no row has one."""
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
        if not rows:
            return None
        keep = set(rows)
        weights = {name: self.get(refs[name], keep) for name in rows}
        if self.ops is not None:
            slots = torch.full((at,), -1, dtype=torch.int32)
            for name, r in rows.items():
                slots[torch.tensor(r)] = self.slot_of[name]
            return LoRAStep([], slots.to(self.device), self.stacks, self.ops)
        groups: list[tuple[LoRAWeights, torch.Tensor | slice]] = []
        for name, r in rows.items():
            whole = r[-1] - r[0] + 1 == len(r)
            groups.append((weights[name], slice(r[0], r[-1] + 1) if whole else torch.tensor(r)))
        return LoRAStep(groups)
