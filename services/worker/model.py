"""The decoder every native decoder family runs (shared/models/families/: Llama, Mistral, Qwen2/3,
Gemma 2/3, Phi-3, Granite, OLMo 2/3, StarCoder2, the mixtures of experts), over a flat, varlen
batch of tokens with a paged KV cache: the ``decoder`` kind of ``Model``
(services/worker/model_interface.py).

The model is written once (``_layer``, ``_head``) over a step's ops and its layers' typed weights
(``DecoderLayer``, services/worker/layer_weights.py), and what a family changes is data in its
``ModelConfig``: where the norms sit (before each block, before and after, or after only),
biases, q/k norms, the activation, sliding windows and soft-caps per layer, multipliers and
RoPE per layer. The step's ops come in two kinds:

- ``HostOps``: the CPU path (kernels/reference.py: batch-invariant GEMM rows, the native C
  decode attention and fused elementwise ops where they build, packed weights);
- ``DeviceOps``: a kernel backend (kernels/ops.py, the Triton kernels on CUDA) over a
  ``DeviceBatch`` of device tensors, with no host synchronisation, so a decode step can be
  captured as a CUDA graph (services/worker/cuda_graphs.py).

The step's tokens are one flat [T] batch (no padding between sequences). Q/K/V and gate/up are
fused into one GEMM each, as in vLLM. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvflow.kernels import cpu_layer_ops
from kvflow.kernels import reference as K
from kvflow.kernels.cpu_gemm import head_packing
from kvflow.kernels.cpu_quant import QuantWeight
from kvflow.kernels.moe import MoEWeights, moe_block
from kvflow.kernels.ops import KernelBackend
from kvflow.services.worker.layer_weights import DecoderLayer, Norm, cat_bias, fuse, packer, tiled
from kvflow.services.worker.model_interface import BaseModel, ForwardBatch, KvCaches, LoadSpec
from kvflow.services.worker.model_loader import load_weights, to_device_weight
from kvflow.services.worker.step_inputs import DeviceBatch
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.rope import cos_sin_table, rope_rows

if TYPE_CHECKING:
    from kvflow.services.worker.lora import LoRAStep
    from kvflow.services.worker.tensor_parallel import TPGroup


class DecoderModel(BaseModel):
    """A decoder built from a ``ModelConfig`` and its family's HF-named weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        fam = self.family
        if fam.split is not None:  # fused checkpoint tensors (Phi-3) under Llama's names
            weights = fam.split(weights, cfg)
        self.scale = cfg.scale
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # a dense table, or GGUF blocks looked up row by row (--quantization gguf on the CPU)
        self.embed: Any = weights["model.embed_tokens.weight"]
        # tied: the embedding itself (dense or blocks)
        self.lm_head: Any = weights.get("lm_head.weight", self.embed)
        final_norm = weights["model.norm.weight"]  # always dense: the model's dtype and device
        self._dtype, self._device = final_norm.dtype, final_norm.device
        self.norm = self._norm_weight(final_norm, weights.get("model.norm.bias"))
        self.layers: list[DecoderLayer] = [
            self._build_layer(weights, i, fam.norms) for i in range(cfg.num_layers)
        ]
        # one cos | sin table per distinct RoPE (Gemma 3: global and local), by layer
        specs = list(dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers)))
        self.rope_tables = [
            cos_sin_table(s, cfg.head_dim, cfg.max_position_embeddings, self._dtype).to(
                self._device
            )
            for s in specs
        ]
        self.rope_specs = specs
        self.layer_table = [specs.index(cfg.layer_rope(i)) for i in range(cfg.num_layers)]
        self.native_layer_ops = False  # the CPU path's fused C elementwise ops (use_native_...)
        # tokens per routed expert, summed over the MoE layers of the steps since the last
        # take_expert_load() (None: none ran)
        self._expert_load: torch.Tensor | None = None

    @classmethod
    def load(cls, src: ModelSource, cfg: ModelConfig, spec: LoadSpec) -> DecoderModel:
        """The checkpoint's weights (services/worker/model_loader.py) as ``spec`` says."""
        return cls.from_weights(cfg, load_weights(src, cfg, spec.dtype, spec.quantization), spec)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, Any], spec: LoadSpec
    ) -> DecoderModel:
        """On the device path the weights move to the device in the backend's layouts (the
        experts stacked for its grouped kernel); on the CPU path dense ones take
        ``spec.dtype``."""
        if spec.device_path:
            embed = weights["model.embed_tokens.weight"]
            if isinstance(embed, QuantWeight) and "lm_head.weight" not in weights:
                weights = {**weights, "lm_head.weight": embed}  # tied: the head keeps the blocks
            weights = {n: to_device_weight(w, spec.device, n) for n, w in weights.items()}
        else:  # in-memory weights in another dtype: the CPU path's own
            weights = {
                n: w.to(spec.dtype) if isinstance(w, torch.Tensor) and w.is_floating_point() else w
                for n, w in weights.items()
            }
        model = cls(cfg, weights)
        if spec.device_path:
            model.stack_experts()  # the grouped Triton kernel reads each layer's experts stacked
        return model

    @property
    def decode_graphs(self) -> bool:  # type: ignore[override]
        """Not with experts: their tokens per expert are data, so MoE steps run eagerly."""
        return not self.cfg.num_experts

    def record_expert_load(self, load: torch.Tensor) -> None:
        """Add one MoE layer's tokens per expert [E] to the load since the last take."""
        self._expert_load = load if self._expert_load is None else self._expert_load + load

    def take_expert_load(self) -> list[int] | None:
        """The tokens each expert took (summed over MoE layers) since the last call; None for a
        dense model or when no MoE layer ran."""
        load, self._expert_load = self._expert_load, None
        return None if load is None else load.tolist()

    def _norm_weight(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> Norm:
        """A norm's scale as the kernels multiply by it: ``offset + w`` (Gemma's ``1 + w``,
        added in fp32 as transformers does); a LayerNorm's is (weight, bias)."""
        if self.cfg.norm_kind == "layer":
            return (w, bias)
        if not self.cfg.norm_offset:
            return w
        return (self.cfg.norm_offset + w.float()).to(w.dtype)

    def _build_layer(self, weights: dict[str, Any], i: int, norms: dict[str, str]) -> DecoderLayer:
        dt, p, moe = self._dtype, f"model.layers.{i}.", self.cfg.is_moe(i)
        attn = [f"{p}self_attn.{n}_proj" for n in "qkv"]
        mlp = [f"{p}mlp.{n}_proj" for n in (("gate", "up") if self.cfg.gated_mlp else ("up",))]
        layer = DecoderLayer(
            qkv=fuse([weights[n + ".weight"] for n in attn], dt),
            qkv_bias=cat_bias(weights, [n + ".bias" for n in attn]),
            o=weights[f"{p}self_attn.o_proj.weight"],
            o_bias=weights.get(f"{p}self_attn.o_proj.bias"),
        )
        if moe:
            layer.moe = self._build_moe(weights, p)
        else:
            layer.gate_up = fuse([weights[n + ".weight"] for n in mlp], dt)
            layer.gate_up_bias = cat_bias(weights, [n + ".bias" for n in mlp])
            layer.down = weights[f"{p}mlp.down_proj.weight"]
            layer.down_bias = weights.get(f"{p}mlp.down_proj.bias")
        for role, name in norms.items():  # a role the family does not name stays None
            w = weights.get(f"{p}{name}.weight")
            if w is not None:
                setattr(layer, role, self._norm_weight(w, weights.get(f"{p}{name}.bias")))
        return layer

    def _build_moe(self, weights: dict[str, Any], p: str) -> MoEWeights:
        """An MoE layer's router and experts (each expert's gate and up fused)."""
        cfg, dt = self.cfg, self._dtype

        def gate_up(prefix: str) -> Any:
            return fuse([weights[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up")], dt)

        experts = [f"{p}mlp.experts.{e}" for e in range(cfg.num_experts)]
        shared = f"{p}mlp.shared_expert"
        return MoEWeights(
            router=weights[f"{p}mlp.gate.weight"],
            gate_up=[gate_up(e) for e in experts],
            down=[weights[f"{e}.down_proj.weight"] for e in experts],
            top_k=cfg.experts_per_token,
            renormalize=cfg.moe_renormalize,
            shared_gate_up=gate_up(shared) if cfg.shared_expert_size else None,
            shared_down=weights[f"{shared}.down_proj.weight"] if cfg.shared_expert_size else None,
            shared_gate=weights[f"{p}mlp.shared_expert_gate.weight"]
            if cfg.shared_expert_size
            else None,
        )

    @property
    def length_dependent_rope(self) -> bool:
        """Whether a token's rotation depends on its sequence's prompt length (longrope)."""
        return any(s.length_dependent for s in self.rope_specs)

    @property
    def cos_sin(self) -> torch.Tensor:
        """The first layer's cos | sin table."""
        return self.rope_tables[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> str:
        """Hold every linear weight pre-packed for the CPU as ``dtype`` GEMMs run
        (layer_weights.packer: quantized blocks multiplied with int8 activations become the
        tiled kernel's layout). The lm_head follows ``cpu_gemm.head_packing``: bf16 panels
        (fp32 sums) or fp32, never a GEMM that rounds the logits to bf16. The embedding stays
        dense for lookups, so a tied lm_head gets a packed copy of its own; quantized, a tied
        embedding and head share one copy. Returns the packing's name."""
        pack, packing = packer(dtype)
        for layer in self.layers:
            layer.pack(pack)
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head = head_packing(dtype)(self.lm_head)
        elif self.lm_head is self.embed:  # tied: one copy, looked up and multiplied
            self.embed = self.lm_head = tiled(self.embed)
        else:
            self.lm_head = tiled(self.lm_head)
        return packing

    def stack_experts(self) -> int:
        """Stack each MoE layer's dense experts for the device path's grouped kernel
        (kernels/triton_moe.py); returns how many layers were (quantized experts stay one
        GEMM per expert)."""
        return sum(layer.moe.stack() for layer in self.layers if layer.moe is not None)

    def use_native_layer_ops(self) -> bool:
        """Run RMSNorm, RoPE with the KV write and the activation of ``forward`` as one C call
        each (kernels/cpu_layer_ops.py) when they can be built; returns whether they are."""
        self.native_layer_ops = (
            self.dtype == torch.float32 and self.device.type == "cpu" and cpu_layer_ops.available()
        )
        return self.native_layer_ops

    def linear_weights(self) -> list[Any]:
        """One linear weight of each distinct shape (what batch-invariance calibration tests)."""
        seen: dict[tuple[int, ...], Any] = {}
        for w in [w for layer in self.layers for w in layer.linears()] + [self.lm_head]:
            seen.setdefault(tuple(w.shape), w)
        return list(seen.values())

    # -- the two paths --------------------------------------------------------------------

    @torch.inference_mode()
    def forward_pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CPU path: ``forward``'s logits, and the final hidden states (after the last
        norm, fp32) [P, hidden] of ``batch.hidden_rows`` (None when there are none): what
        embedding requests pool."""
        st = HostOps(self, batch, positions)
        h, residual = self._body(st, input_ids, kv_caches, batch.lora)
        return self._head(st, h, residual, batch.sample_rows, batch.hidden_rows)

    @torch.inference_mode()
    def forward_device_pooled(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: KvCaches,
        hidden_rows: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device path: one step through ``ops``, linear layers through ``K.linear``
        (``F.linear``, cuBLAS on CUDA, for dense weights; a quantized weight's own kernel
        otherwise); returns fp32 logits [S, vocab] for ``batch.sample_rows`` (every row when
        None) and, with ``hidden_rows``, the final hidden states of those rows (fp32). No host
        synchronisation: safe to capture in a CUDA graph when ``batch`` holds static tensors
        and, for decode, a fixed ``num_splits``."""
        st = DeviceOps(self, ops, batch)
        h, residual = self._body(st, batch.input_ids, kv_caches, lora)
        return self._head(st, h, residual, batch.sample_rows, hidden_rows)

    # -- the model, once ----------------------------------------------------------------------

    def _body(
        self,
        st: StepOps,
        input_ids: torch.Tensor,
        kv_caches: KvCaches,
        lora: LoRAStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings through every layer: (h, residual), whose sum is the residual stream
        (vLLM's fused-residual form: a norm adds them as it reads them)."""
        tp = self.tp
        h = self.embed[input_ids] if tp is None else tp.embed(input_ids, self.embed)
        if self.cfg.embed_scale != 1.0:
            h = h * self.cfg.embed_scale
        residual: torch.Tensor | None = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = self._layer(st, i, layer, cache, h, residual, lora)
        return h, residual

    def _layer(
        self,
        st: StepOps,
        i: int,
        layer: DecoderLayer,
        cache: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        residual: torch.Tensor | None,
        lora: LoRAStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg, tp = self.cfg, self.tp
        post = cfg.norm_layout == "post"
        if post:  # no norm before the block: it reads the stream itself
            x = h if residual is None else h + residual
            residual = x
        else:
            x, residual = st.norm(h, layer.attn_norm, residual)
        qkv = _plus(st.linear(x, layer.qkv), layer.qkv_bias)
        qkv = _lora(lora, i, "qkv", x, qkv)
        if cfg.qk_norm:
            qkv = self._qk_norm(st, layer, qkv)
        q = st.rope_write(qkv, self.layer_table[i], cache)
        o = st.attend(q, cache, cfg.window(i), cfg.attn_softcap).reshape(-1, self.q_size)
        h = _reduce(tp, _lora(lora, i, "o", o, st.linear(o, layer.o)))
        h = _plus(h, layer.o_bias)
        if layer.attn_out_norm is not None:
            h = st.norm(h, layer.attn_out_norm)[0]
        if cfg.residual_multiplier != 1.0:
            h = h * cfg.residual_multiplier
        if post:
            x = h + residual
            residual = x
        else:
            x, residual = st.norm(h, layer.mlp_norm, residual)
        if layer.moe is not None:
            h, load = moe_block(x, layer.moe, st.linear, st.head_linear, st.act)
            h = _reduce(tp, h)  # each rank's experts hold a slice of their features
            st.expert_load(i, load)
        else:
            gate_up = _lora(
                lora, i, "gate_up", x, _plus(st.linear(x, layer.gate_up), layer.gate_up_bias)
            )
            m = st.act(gate_up)
            h = _reduce(tp, _lora(lora, i, "down", m, st.linear(m, layer.down)))
            h = _plus(h, layer.down_bias)
        if layer.mlp_out_norm is not None:
            h = st.norm(h, layer.mlp_out_norm)[0]
        if cfg.residual_multiplier != 1.0:
            h = h * cfg.residual_multiplier
        return h, residual

    def _qk_norm(self, st: StepOps, layer: DecoderLayer, qkv: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the queries and keys before RoPE: per head (Qwen3, Gemma 3) or over the
        whole projection (OLMo 2). Returns the new fused q | k | v rows."""
        t, qs, ks, d = qkv.shape[0], self.q_size, self.kv_size, self.cfg.head_dim
        q, k, v = qkv[:, :qs], qkv[:, qs : qs + ks], qkv[:, qs + ks :]
        if self.cfg.qk_norm == "head":
            q = st.norm(q.reshape(-1, d), layer.q_norm)[0].view(t, qs)
            k = st.norm(k.reshape(-1, d), layer.k_norm)[0].view(t, ks)
        else:
            q = st.norm(q.contiguous(), layer.q_norm)[0]
            k = st.norm(k.contiguous(), layer.k_norm)[0]
        return torch.cat([q, k, v], dim=1)

    def _head(
        self,
        st: StepOps,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        sample_rows: torch.Tensor | None,
        hidden_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final norm, then logits of ``sample_rows`` (all when None) and the hidden states of
        ``hidden_rows``."""
        cfg = self.cfg
        if residual is None:  # no layer added to it (never for a real model)
            residual = torch.zeros_like(h)
        hidden = None
        if hidden_rows is not None:  # before the head's norm, which may update in place
            hr = (h.index_select(0, hidden_rows), residual.index_select(0, hidden_rows))
            hidden = st.norm(hr[0], self.norm, hr[1])[0].float()
        if sample_rows is not None:
            h = h.index_select(0, sample_rows)
            residual = residual.index_select(0, sample_rows)
        x, _ = st.norm(h, self.norm, residual)
        logits = st.head_linear(x, self.lm_head).float()
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, cfg.vocab_size)
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits, hidden


class StepOps:
    """One step's ops over the model's weights (what differs between the two paths)."""

    model: DecoderModel

    def norm(
        self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        raise NotImplementedError

    def head_linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        raise NotImplementedError

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expert_load(self, layer: int, load: torch.Tensor) -> None:
        """Record the tokens each expert of MoE layer ``layer`` took this step."""
        self.model.record_expert_load(load)

    def rope_write(
        self, qkv: torch.Tensor, table: int, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Rotate q and k of ``qkv`` with RoPE table ``table``, store k and v in ``cache``;
        return q [T, H, D]."""
        raise NotImplementedError

    def attend(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], window: int, cap: float
    ) -> torch.Tensor:
        raise NotImplementedError

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Strided views of q [T, H, D], k and v [T, Hkv, D] into ``qkv``: no copies."""
        m, t = self.model, qkv.shape[0]
        cfg, qs, ks = m.cfg, m.q_size, m.kv_size
        q = qkv[:, :qs].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, qs : qs + ks].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, qs + ks :].view(t, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v


def _act_torch(kind: str, x: torch.Tensor, gated: bool = True) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate | up projection in plain torch (``act(x)`` when not
    ``gated``)."""
    if not gated:
        if kind == "silu":
            return F.silu(x)
        return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")
    if kind == "silu":
        return K.silu_and_mul(x)
    if kind == "gelu_tanh":
        return K.gelu_tanh_and_mul(x)
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


class HostOps(StepOps):
    """The CPU path: batch-invariant GEMM rows, native C ops where they built."""

    def __init__(self, model: DecoderModel, batch: ForwardBatch, positions: torch.Tensor) -> None:
        self.model, self.batch = model, batch
        self.native = model.native_layer_ops
        self.eps = model.cfg.rms_norm_eps
        # each table's row of every token (longrope moves long sequences to its long rows)
        plens, maxpos = batch.token_prompt_lens, model.cfg.max_position_embeddings
        self.rows = [
            rope_rows(s, positions, plens, maxpos) if plens is not None else positions
            for s in model.rope_specs
        ]

    def norm(
        self, x: torch.Tensor, w: Any, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(w, tuple):
            return _layer_norm(x, w, self.eps, residual)
        if self.native:
            return cpu_layer_ops.add_rms_norm(x, w, self.eps, residual)
        return K.rms_norm(x, w, self.eps, residual)

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        return K.linear(x, w, self.batch.rows)

    def head_linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        rows = self.batch.rows
        s = x.shape[0]
        head_rows = None if rows is None else K.RowLayout(s, (), rows.tile, rows.pad)
        return K.linear(x, w, head_rows)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        cfg = self.model.cfg
        kind = cfg.hidden_act
        if self.native and cfg.gated_mlp and kind == "silu":
            return cpu_layer_ops.silu_and_mul(gate_up)
        if self.native and cfg.gated_mlp and kind == "gelu_tanh":
            return cpu_layer_ops.gelu_tanh_and_mul(gate_up)
        return _act_torch(kind, gate_up, cfg.gated_mlp)

    def rope_write(
        self, qkv: torch.Tensor, table: int, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        m, slots = self.model, self.batch.slot_mapping
        cos_sin, rows = m.rope_tables[table], self.rows[table]
        if self.native:
            cfg = m.cfg
            return cpu_layer_ops.rope_write_kv(
                qkv, cfg.num_heads, cfg.num_kv_heads, rows, cos_sin, cache[0], cache[1], slots
            )
        q, k, v = self._split(qkv)
        q, k = K.rotary_embedding(rows, q, k, cos_sin)
        K.write_kv_cache(k, v, cache[0], cache[1], slots)
        return q

    def attend(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], window: int, cap: float
    ) -> torch.Tensor:
        plan, scale = self.batch.attn, self.model.scale
        return K.paged_attention(
            q, cache[0], cache[1], None, None, None, scale, plan=plan, window=window, softcap=cap
        )


class DeviceOps(StepOps):
    """The device path: a kernel backend over a ``DeviceBatch``; no host syncs."""

    def __init__(self, model: DecoderModel, ops: KernelBackend, batch: DeviceBatch) -> None:
        self.model, self.ops, self.batch = model, ops, batch
        self.eps = model.cfg.rms_norm_eps
        plens, maxpos = batch.prompt_lens, model.cfg.max_position_embeddings
        self.rows = [
            rope_rows(s, batch.positions, plens, maxpos) if plens is not None else batch.positions
            for s in model.rope_specs
        ]

    def norm(
        self, x: torch.Tensor, w: Any, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(w, tuple):
            return _layer_norm(x, w, self.eps, residual)
        return self.ops.rms_norm(x, w, self.eps, residual)

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        return K.linear(x, w)

    def head_linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        return K.linear(x, w)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        cfg = self.model.cfg
        if cfg.gated_mlp and cfg.hidden_act == "silu":
            return self.ops.silu_and_mul(gate_up)
        if cfg.gated_mlp and cfg.hidden_act == "gelu_tanh":
            return self.ops.gelu_tanh_and_mul(gate_up)
        return _act_torch(cfg.hidden_act, gate_up, cfg.gated_mlp)

    def rope_write(
        self, qkv: torch.Tensor, table: int, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        # strided views into qkv: the kernels take row/head strides, so no copies here
        q, k, v = self._split(qkv)
        cos_sin = self.model.rope_tables[table]
        q, k = self.ops.rotary_embedding(self.rows[table], q, k, cos_sin)
        self.ops.write_kv_cache(k, v, cache[0], cache[1], self.batch.slot_mapping)
        return q

    def attend(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], window: int, cap: float
    ) -> torch.Tensor:
        b, scale = self.batch, self.model.scale
        if b.query_start_loc is None:
            return self.ops.decode_attention(
                q,
                cache[0],
                cache[1],
                b.block_tables,
                b.seq_lens,
                scale,
                b.num_splits,
                window=window,
                softcap=cap,
            )
        return self.ops.extend_attention(
            q,
            cache[0],
            cache[1],
            b.block_tables,
            b.seq_lens,
            b.query_start_loc,
            b.max_query_len,
            scale,
            window=window,
            softcap=cap,
        )


def _layer_norm(
    x: torch.Tensor,
    wb: tuple[torch.Tensor, torch.Tensor | None],
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm (StarCoder2) in the norms' fused-residual form: normalise ``x + residual`` and
    return that sum too. One ATen kernel each way (a row's result does not depend on others)."""
    s = x if residual is None else x + residual
    return F.layer_norm(s, (s.shape[-1],), wb[0], wb[1], eps), s


def _plus(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x + bias`` in place (x is a fresh GEMM output), or ``x`` without a bias."""
    return x if bias is None else x.add_(bias)


def _reduce(tp: TPGroup | None, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output: summed over the ranks (as it is without them)."""
    return partial if tp is None else tp.reduce(partial)


def _lora(
    lora: LoRAStep | None, layer: int, group: str, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (a projection of ``x``) plus its rows' LoRA deltas, in place."""
    if lora is not None:
        lora.apply(layer, group, x, out)
    return out
