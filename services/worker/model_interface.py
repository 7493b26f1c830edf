"""The one interface the worker holds a model by: ``Model``, which every kind of model implements
(services/worker/model_kinds.py lists them: the decoder of the native families, the
Transformers fallback, the encoder of the pooling models; next, vision towers and state-space
models). The runner (services/worker/runner.py) and its setup (model_setup.py) ask the model
what they need, never which kind it is:

- loading: ``load`` from a checkpoint, ``from_weights`` from in-memory Hugging Face-named
  tensors (tests, tensor-parallel shards), both as a ``LoadSpec`` says;
- what it serves: ``generates`` (samples tokens; else pooling requests only), ``whole_inputs``
  (computes every input whole in one step: bidirectional attention), ``decode_graphs`` (decode
  steps may replay CUDA graphs), ``family`` (its refusals of tensor parallelism and LoRA:
  ``tp`` refuses a group it cannot run with), ``classifier`` (a classification head over
  pooled vectors);
- its KV cache: ``kv_cache_spec`` (the bytes of a block, and whether anything is kept between
  steps: an encoder keeps nothing) and ``make_kv_caches``;
- the forward pass of a step's rows: ``forward_pooled`` on the CPU path over a
  ``ForwardBatch``, ``forward_device_pooled`` on the device path over a ``DeviceBatch``
  (services/worker/step_inputs.py): logits of the rows that sample and the final hidden states
  of the rows that pool; ``forward`` / ``forward_device`` the logits alone;
- the CPU path's setup: ``pack_weights``, ``use_native_layer_ops``, ``linear_weights`` (what
  batch-invariance calibration tests), ``length_dependent_rope``, ``take_expert_load``.

``BaseModel`` holds what every kind does alike, once; a kind subclasses it and implements the
rest (``Model`` lists all, with what each means)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvflow.kernels import reference as K
from kvflow.kernels.ops import KernelBackend
from kvflow.services.worker.step_inputs import DeviceBatch
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.family import Family
from kvflow.shared.models.registry import family

if TYPE_CHECKING:
    from kvflow.services.worker.lora import LoRAStep
    from kvflow.services.worker.tensor_parallel import TPGroup

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""One (k, v) pair per layer, each [num_blocks, block_size, Hkv, D]."""


@dataclass
class ForwardBatch:
    """Everything one CPU-path forward pass needs besides the token ids and positions."""

    slot_mapping: torch.Tensor  # [T] cache slot of each token (-1: do not write)
    attn: K.AttentionPlan  # gathers for paged attention
    rows: K.RowLayout | None  # how rows go through GEMMs (None: one plain GEMM)
    sample_rows: torch.Tensor  # [S] indices into T whose logits are wanted
    hidden_rows: torch.Tensor | None = None  # [P] rows whose final hidden states are wanted
    lora: LoRAStep | None = None  # the LoRA adapters of the step's rows (services/worker/lora.py)
    # [T] each token's sequence's prompt length (length-dependent RoPE: shared/models/rope.py)
    token_prompt_lens: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None  # [B] each sequence's tokens, in row order
    # [T] each token's segment of a text pair (0, 1: models with token-type embeddings);
    # None: every token 0
    token_types: torch.Tensor | None = None


@dataclass(frozen=True)
class KvCacheSpec:
    """A model's KV cache: per layer, K and V of ``num_kv_heads`` heads of ``head_dim`` in
    ``dtype``. ``kept`` False: nothing is kept between steps (an encoder computes each input
    whole), so nothing is allocated and the blocks only count the tokens in flight, as many as
    the cache's budget would hold if they were."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kept: bool = True

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block: K and V of every layer."""
        bits = torch.finfo(self.dtype).bits
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * bits // 8

    def with_kv_heads(self, num_kv_heads: int) -> KvCacheSpec:
        """The same cache holding ``num_kv_heads`` heads (a tensor-parallel rank's share)."""
        return dataclasses.replace(self, num_kv_heads=num_kv_heads)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KvCaches:
        """The caches, zero filled (so padded gathers never meet NaNs); none when not kept."""
        if not self.kept:
            return []
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, kept: bool = True) -> KvCacheSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, kept)


@dataclass(frozen=True)
class LoadSpec:
    """How a model is built: its weights' ``dtype`` (the CPU path builds in fp32; bf16 is then
    its GEMMs' dtype: ``pack_weights``), its ``device``, the weight scheme
    (``quantization``, checked by model_setup.check_quantization) and whether the kernel
    backend runs it (``device_path``: weights in the backend's layouts)."""

    dtype: torch.dtype
    device: torch.device
    quantization: str = ""
    device_path: bool = False


class Model(Protocol):
    """What the worker asks of a model (see the module docstring)."""

    cfg: ModelConfig
    generates: bool  # samples tokens from logits; False: pooling requests only
    whole_inputs: bool  # every input is computed whole in one step (bidirectional attention)
    native_layer_ops: bool  # the CPU path's fused C elementwise ops run (use_native_layer_ops)
    # the KV cache's dtype where it is not the model's: bf16 on the CPU path's --dtype bfloat16
    # (model_setup.load_model), whose model computes in fp32 around its bf16 GEMMs
    kv_cache_dtype: torch.dtype | None

    @classmethod
    def load(cls, src: ModelSource, cfg: ModelConfig, spec: LoadSpec) -> Model:
        """The model of the checkpoint ``src`` (whose config is ``cfg``)."""
        ...

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, Any], spec: LoadSpec) -> Model:
        """The model of in-memory Hugging Face-named ``weights``."""
        ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def family(self) -> Family:
        """Its family (shared/models/registry.py): what it refuses, among the rest."""
        ...

    @property
    def tp(self) -> TPGroup | None:
        """This rank's tensor-parallel collectives (None: the whole model here); setting a
        group raises ValueError where the family refuses tensor parallelism."""
        ...

    @tp.setter
    def tp(self, group: TPGroup | None) -> None: ...

    @property
    def decode_graphs(self) -> bool:
        """Whether decode steps may be captured as CUDA graphs (their shapes are fixed)."""
        ...

    @property
    def length_dependent_rope(self) -> bool:
        """Whether a token's rotation depends on its sequence's prompt length (longrope): the
        device path then passes ``DeviceBatch.prompt_lens``."""
        ...

    @property
    def classifier(self) -> Any:
        """Its classification head (a pooled vector [hidden] -> logits [labels]), or None."""
        ...

    @property
    def score_activation(self) -> str:
        """A one-label head's score: ``sigmoid`` | ``identity``."""
        ...

    def kv_cache_spec(self) -> KvCacheSpec: ...

    def make_kv_caches(self, num_blocks: int, block_size: int) -> KvCaches: ...

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> str:
        """Hold the linear weights pre-packed for the CPU as ``dtype`` GEMMs run them
        (kernels/cpu_gemm.py); returns the packing's name."""
        ...

    def use_native_layer_ops(self) -> bool:
        """Run the CPU path's elementwise ops as fused C calls where it can; whether it does."""
        ...

    def linear_weights(self) -> list[Any]:
        """One linear weight of each distinct shape (what batch-invariance calibration tests)."""
        ...

    def take_expert_load(self) -> list[int] | None:
        """Tokens per routed expert since the last call (None: no mixture of experts ran)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> torch.Tensor: ...

    def forward_pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CPU path: fp32 logits [S, vocab] of ``batch.sample_rows`` and the final hidden
        states (after the last norm, fp32) [P, hidden] of ``batch.hidden_rows`` (None when
        there are none)."""
        ...

    def forward_device(
        self, ops: KernelBackend, batch: DeviceBatch, kv_caches: KvCaches
    ) -> torch.Tensor: ...

    def forward_device_pooled(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: KvCaches,
        hidden_rows: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device path: fp32 logits [S, vocab] of ``batch.sample_rows`` (every row when
        None) and, with ``hidden_rows``, those rows' final hidden states (fp32)."""
        ...


class BaseModel(torch.nn.Module):
    """What every kind of model does alike (``Model``'s shared members): its family, its
    tensor-parallel group behind the family's refusal, a KV cache of the config's shape, the
    logits-only forwards, and the defaults of a kind without experts, native layer ops,
    length-dependent RoPE or a classification head."""

    cfg: ModelConfig
    generates = True
    whole_inputs = False
    decode_graphs = True
    length_dependent_rope = False
    native_layer_ops = False
    kv_cache_dtype: torch.dtype | None = None
    classifier: Any = None
    score_activation = "sigmoid"
    _tp: TPGroup | None = None

    @property
    def family(self) -> Family:
        return family(self.cfg.family)

    @property
    def tp(self) -> TPGroup | None:
        return self._tp

    @tp.setter
    def tp(self, group: TPGroup | None) -> None:
        refused = self.family.refusal(tensor_parallel=group is not None)
        if refused:
            raise ValueError(refused)
        self._tp = group

    def refuse_lora(self, lora: LoRAStep | None) -> None:
        """ValueError when a step brings LoRA adapters that the family refuses."""
        refused = self.family.refusal(lora=lora is not None)
        if refused:
            raise ValueError(refused)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds (``kv_cache_dtype``, else the model's)."""
        return self.kv_cache_dtype or self.dtype

    def kv_cache_spec(self) -> KvCacheSpec:
        return KvCacheSpec.of(self.cfg, self.kv_dtype)

    def make_kv_caches(self, num_blocks: int, block_size: int) -> KvCaches:
        return self.kv_cache_spec().allocate(num_blocks, block_size, self.device)

    def use_native_layer_ops(self) -> bool:
        return False

    def take_expert_load(self) -> list[int] | None:
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> torch.Tensor:
        """``forward_pooled``'s logits."""
        return self.forward_pooled(input_ids, positions, batch, kv_caches)[0]

    def forward_device(
        self, ops: KernelBackend, batch: DeviceBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        """``forward_device_pooled``'s logits, without hidden rows."""
        return self.forward_device_pooled(ops, batch, kv_caches)[0]
