"""``--model-impl transformers``: any causal LM that transformers can build, run through
kvflow's paged KV cache (vLLM's "Transformers backend").

transformers v5 looks attention up by name in a registry (``AttentionInterface``) and calls it
with the layer's queries, keys and values after RoPE. kvflow registers its own function under
``ATTN_IMPLEMENTATION`` and builds the model with ``attn_implementation`` set to it, so every
attention layer of the Hugging Face model writes its new K/V into the layer's paged cache at
the step's slots and attends over the cache: continuous batching, chunked prefill, prefix
caching and preemption work as with the native ``DecoderModel`` (services/worker/model.py),
behind the same ``Model`` interface (services/worker/model_interface.py).

- The step's flat varlen batch runs as one row (``input_ids[None]``, ``position_ids`` the
  tokens' own positions) with no transformers cache; sequences are separated by the paged
  attention (the step's ``AttentionPlan`` on the CPU path, the kernel backend's decode / extend
  attention on the device path), which honours the ``scaling``, ``sliding_window`` and
  ``softcap`` each layer passes.
- The name is deliberately absent from ``masking_utils.AttentionMaskInterface``: for such an
  implementation ``create_causal_mask`` returns None at once (transformers' path for TGI/vLLM
  backends), so no dense T x T mask is built.
- The step's context (caches, slots, attention plan, GEMM row layout) reaches the attention
  function and the linear layers through a context variable set around the model's forward
  only: two models never see each other's step, and a call outside a step is an error.
- Every ``nn.Linear`` (and GPT-2's ``Conv1D``) is replaced by a ``StepLinear`` computed by
  ``kernels.reference.linear`` over the step's ``RowLayout``, with kvflow's packed weights on
  the CPU: a sequence's logits are bit-identical whatever else shares the step, as with the
  native model.

What it refuses (ValueError): tensor parallelism, LoRA adapters, quantization, models that are
not causal LMs or are encoder-decoders, and models whose layers do not all attend through
the registry (checked by a warm-up forward at construction: the function must run once per
layer with the config's head shapes and no mask of the model's own).
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import transformers
from transformers.pytorch_utils import Conv1D

from kvflow.kernels import reference as K
from kvflow.kernels.cpu_gemm import head_packing, linear_packing
from kvflow.kernels.ops import KernelBackend
from kvflow.services.worker.model_interface import BaseModel, ForwardBatch, KvCaches, LoadSpec
from kvflow.services.worker.step_inputs import DeviceBatch
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models import generic
from kvflow.shared.models.config import ModelConfig

if TYPE_CHECKING:
    from kvflow.services.worker.lora import LoRAStep


ATTN_IMPLEMENTATION = "kvflow_paged"
"""The name kvflow's attention is registered under in transformers' ``AttentionInterface``."""


# attention(q [T, H, D], k [T, Hkv, D], v, layer, scale, window, softcap) -> [T, H, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int, float], torch.Tensor]


@dataclass
class StepContext:
    """What one forward pass's attention calls and linear layers read (set around it)."""

    attend: Attend
    num_tokens: int  # T: the rows the step's GEMM layout describes
    rows: K.RowLayout | None = None  # GEMM row layout of the T token rows (CPU path)
    head_rows: K.RowLayout | None = None  # the same for the sampled rows through the LM head
    hidden_rows: torch.Tensor | None = None  # rows whose final hidden states are wanted
    hidden: torch.Tensor | None = None  # those hidden states (set by the base model's hook)
    calls: list[tuple[int, tuple[int, ...], tuple[int, ...], bool]] = field(default_factory=list)
    # per attention call: (layer, q shape, k shape, whether a mask of the model's own came)


_STEP: ContextVar[StepContext | None] = ContextVar("kvflow_transformers_step", default=None)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [1, H, T, D], key / value
    [1, Hkv, T, D], RoPE applied) over kvflow's paged cache: the current step's ``attend``
    writes the layer's new K/V and attends. Returns ([1, T, H, D], no weights)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} runs only inside a TransformersModel "
            "step (services/worker/transformers_model.py)"
        )
    layer = getattr(module, "layer_idx", None)
    step.calls.append(
        (
            -1 if layer is None else int(layer),
            tuple(query.shape),
            tuple(key.shape),
            attention_mask is not None or getattr(module, "is_causal", True) is False,
        )
    )
    if layer is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{type(module).__name__}: not a causal self-attention layer with a layer_idx "
            f"(query {tuple(query.shape)}, key {tuple(key.shape)})"
        )
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.attend(q, k, v, int(layer), scale, int(sliding_window or 0), float(softcap or 0))
    return out[None], None


transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def _host_attend(kv_caches: KvCaches, batch: ForwardBatch) -> Attend:
    """The CPU path: kernels/reference.py's cache write and paged attention with the step's
    plan (the native C decode kernel where the plan has one)."""

    def attend(q, k, v, layer, scale, window, cap):  # noqa: ANN001, ANN202
        kc, vc = kv_caches[layer]
        K.write_kv_cache(k, v, kc, vc, batch.slot_mapping)
        return K.paged_attention(
            q, kc, vc, None, None, None, scale, plan=batch.attn, window=window, softcap=cap
        )

    return attend


def _device_attend(ops: KernelBackend, kv_caches: KvCaches, b: DeviceBatch) -> Attend:
    """The device path: the backend's cache write and decode / extend attention (no host
    synchronisation, as ``DecoderModel``'s ``DeviceOps``)."""

    def attend(q, k, v, layer, scale, window, cap):  # noqa: ANN001, ANN202
        kc, vc = kv_caches[layer]
        ops.write_kv_cache(k, v, kc, vc, b.slot_mapping)
        if b.query_start_loc is None:
            return ops.decode_attention(
                q,
                kc,
                vc,
                b.block_tables,
                b.seq_lens,
                scale,
                b.num_splits,
                window=window,
                softcap=cap,
            )
        return ops.extend_attention(
            q,
            kc,
            vc,
            b.block_tables,
            b.seq_lens,
            b.query_start_loc,
            b.max_query_len,
            scale,
            window=window,
            softcap=cap,
        )

    return attend


def _probe_attend(q, k, v, layer, scale, window, cap):  # noqa: ANN001, ANN202
    """The warm-up's attention: plain causal SDPA on the call's own tokens (no cache)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o[0].transpose(0, 1)


class StepLinear(torch.nn.Module):
    """A linear layer computed as ``kernels.reference.linear`` over the current step's GEMM row
    layout (batch invariance on the CPU path), the weight dense or packed (``pack``). ``head``:
    the LM head, whose rows are the sampled rows (laid out as the native model's head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, head: bool) -> None:
        super().__init__()
        self.w: torch.Tensor | K.Weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.head = head
        # ``.weight`` for modeling code that reads its dtype or shape (never its values)
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, mod: torch.nn.Module, head: bool) -> StepLinear:
        """From an ``nn.Linear`` (weight [out, in]) or a GPT-2 ``Conv1D`` (weight [in, out])."""
        w = mod.weight.t().contiguous() if isinstance(mod, Conv1D) else mod.weight
        return cls(w, mod.bias, head)

    def pack(self, kind: type) -> None:
        """Hold the weight pre-packed (a ``kernels.cpu_gemm.linear_packing`` kind)."""
        if isinstance(self.w, torch.Tensor):
            self.w = kind(self.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = _STEP.get()
        x2 = x.reshape(-1, x.shape[-1])
        layout = None
        if step is not None and self.head:
            layout = step.head_rows
        elif step is not None and x2.shape[0] == step.num_tokens:
            layout = step.rows
        y = K.linear(x2, self.w, layout)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def _replace_linears(hf: torch.nn.Module) -> list[StepLinear]:
    """Every ``nn.Linear`` / ``Conv1D`` under ``hf`` replaced in place by a ``StepLinear`` (one
    per distinct module, shared ones stay shared); returns them."""
    head = hf.get_output_embeddings()
    done: dict[int, StepLinear] = {}
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (torch.nn.Linear, Conv1D)):
                continue
            new = done.get(id(child))
            if new is None:
                new = done[id(child)] = StepLinear.of(child, head=child is head)
            setattr(parent, name, new)
    return list(done.values())


def _ids(v: Any) -> list[int]:
    return [] if v is None else [int(i) for i in (v if isinstance(v, (list, tuple)) else [v])]


class TransformersModel(BaseModel):
    """A Hugging Face causal LM with kvflow's attention and linear layers: the ``transformers``
    kind of ``Model`` (services/worker/model_interface.py); its family (the fallback,
    shared/models/generic.py) refuses tensor parallelism and LoRA adapters."""

    def __init__(self, hf: torch.nn.Module, cfg: ModelConfig) -> None:
        """``hf`` must already use ``attn_implementation=ATTN_IMPLEMENTATION``; its linear
        layers are replaced here, then a warm-up forward checks every layer attends through
        kvflow (ValueError otherwise)."""
        super().__init__()
        if hf.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"the model must be built with {ATTN_IMPLEMENTATION=}")
        self.hf = hf.eval()
        self.cfg = cfg
        if hf.base_model is hf:
            raise ValueError(
                f"{type(hf).__name__}: no base model inside the causal LM (base_model_prefix) "
                "to take final hidden states from"
            )
        self.linears = _replace_linears(hf)
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf.forward).parameters
        hf.base_model.register_forward_hook(_keep_hidden)
        self._check_attention()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantization: str = "",
    ) -> TransformersModel:
        """Load a Hugging Face directory with ``AutoModelForCausalLM`` (kvflow's attention)."""
        path = Path(path)
        if quantization:
            raise ValueError(
                f"--quantization {quantization}: --model-impl transformers serves unquantized "
                "weights only (use the native implementation)"
            )
        where = f"{path}/config.json"
        raw = json.loads((path / "config.json").read_text())
        eos: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = _ids(json.loads(gen.read_text()).get("eos_token_id"))
        cfg = generic.transformers_config(raw, where, eos)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
        return cls(hf.to(device), cfg)

    @classmethod
    def load(cls, src: ModelSource, cfg: ModelConfig, spec: LoadSpec) -> TransformersModel:
        return cls.from_pretrained(src.path, spec.dtype, spec.device, spec.quantization)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, Any], spec: LoadSpec
    ) -> TransformersModel:
        raise ValueError(
            "--model-impl transformers builds its model from a Hugging Face directory "
            "(load), or wraps a built one (from_model), not from loose weights"
        )

    @classmethod
    def from_model(cls, hf: torch.nn.Module) -> TransformersModel:
        """Wrap a copy of an in-memory transformers causal LM (tests): the caller's model keeps
        its own attention and linear layers."""
        cfg = generic.transformers_config(hf.config.to_dict(), type(hf).__name__, [])
        hf = copy.deepcopy(hf)
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
        return cls(hf, cfg)

    # -- what the runner reads (the rest is BaseModel's: the HF modules compute their own norms,
    # RoPE and activations, so no native layer ops and no length-dependent RoPE here) --------

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> str:
        """Every linear weight pre-packed for the CPU, as ``DecoderModel.pack_weights``;
        returns the packing's name."""
        kind, name = linear_packing(dtype)
        head_kind = head_packing(dtype)  # never logits rounded to bf16 (DecoderModel's)
        for lin in self.linears:
            lin.pack(head_kind if lin.head else kind)
        return name

    def linear_weights(self) -> list[Any]:
        """One linear weight of each distinct shape (what batch-invariance calibration tests)."""
        seen: dict[tuple[int, ...], Any] = {}
        for lin in self.linears:
            seen.setdefault(tuple(lin.w.shape), lin.w)
        return list(seen.values())

    # -- the two paths ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CPU path: ``forward``'s logits, and the final hidden states (the base model's
        output, after its last norm; fp32) [P, hidden] of ``batch.hidden_rows`` (None when
        there are none)."""
        self.refuse_lora(batch.lora)
        rows, s = batch.rows, batch.sample_rows.numel()
        step = StepContext(
            _host_attend(kv_caches, batch),
            input_ids.numel(),
            rows,
            None if rows is None else K.RowLayout(s, (), rows.tile, rows.pad),
            batch.hidden_rows,
        )
        return self._run(step, input_ids, positions, batch.sample_rows)

    @torch.inference_mode()
    def forward_device_pooled(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: KvCaches,
        hidden_rows: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device path: attention through ``ops`` (no host synchronisation), linear layers
        dense (cuBLAS on CUDA); fp32 logits [S, vocab] of ``batch.sample_rows`` (every row when
        None) and, with ``hidden_rows``, those rows' final hidden states (fp32)."""
        self.refuse_lora(lora)
        attend = _device_attend(ops, kv_caches, batch)
        step = StepContext(attend, batch.input_ids.numel(), hidden_rows=hidden_rows)
        return self._run(step, batch.input_ids, batch.positions, batch.sample_rows)

    def _run(
        self,
        step: StepContext,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The HF model on the step's tokens as one row, ``step`` visible to its attention and
        linear layers for exactly this call; logits of ``sample_rows`` (all when None). Where
        the model's forward takes ``logits_to_keep``, its own head runs (with whatever it does
        after the LM head: soft-caps, logit scales); else the base model, then the LM head."""
        ids, pos = input_ids[None], positions[None]
        token = _STEP.set(step)
        try:
            if self._keeps_logits:
                keep = 0 if sample_rows is None else sample_rows.long()
                out = self.hf(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
                logits = out.logits[0]
            else:
                h = self.hf.base_model(input_ids=ids, position_ids=pos, use_cache=False)[0][0]
                if sample_rows is not None:
                    h = h.index_select(0, sample_rows)
                logits = self.hf.get_output_embeddings()(h)
        finally:
            _STEP.reset(token)
        return logits.float(), step.hidden

    # -- the construction check ----------------------------------------------------------------

    @torch.inference_mode()
    def _check_attention(self, n: int = 4) -> None:
        """A warm-up forward of ``n`` tokens: kvflow's attention must run once for each layer,
        with the config's head counts and head size, on a causal self-attention with no mask
        of the model's own; ValueError naming what differs otherwise."""
        cfg, name = self.cfg, type(self.hf).__name__
        step = StepContext(_probe_attend, n)
        pos = torch.arange(n, device=self.device)
        token = _STEP.set(step)
        try:
            self.hf(input_ids=pos[None] % cfg.vocab_size, position_ids=pos[None], use_cache=False)
        except Exception as e:
            raise ValueError(
                f"{name}: the warm-up forward through kvflow's attention failed: {e}"
            ) from e
        finally:
            _STEP.reset(token)
        layers = sorted(c[0] for c in step.calls)
        if not layers:
            raise ValueError(
                f"{name}: the model's attention does not support transformers' attention "
                "interface (it never called the registered attention function); use a model "
                "with a native implementation"
            )
        if layers != list(range(cfg.num_layers)):
            raise ValueError(
                f"{name}: kvflow's attention ran for layers {layers} of {cfg.num_layers}: not "
                "every layer's attention goes through transformers' attention interface"
            )
        want_q = (1, cfg.num_heads, n, cfg.head_dim)
        want_k = (1, cfg.num_kv_heads, n, cfg.head_dim)
        for layer, q, k, own_mask in step.calls:
            if q != want_q or k != want_k:
                raise ValueError(
                    f"{name} layer {layer}: attention shapes q {q}, k {k}; the config says "
                    f"q {want_q}, k {want_k}"
                )
            if own_mask:
                raise ValueError(
                    f"{name} layer {layer}: a mask of the model's own or non-causal attention, "
                    "which the paged cache's causal attention cannot honour"
                )


def _keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook on the base model: the current step's ``hidden_rows`` of its output."""
    step = _STEP.get()
    if step is not None and step.hidden_rows is not None:
        step.hidden = output[0][0].index_select(0, step.hidden_rows).float()
