"""The encoder every encoder family runs (shared/models/families/bert.py: BERT, RoBERTa,
XLM-RoBERTa): the ``encoder`` kind of ``Model`` (services/worker/model_interface.py), over a
step of whole inputs laid end to end (the runner's rows, ``ForwardBatch.query_lens`` tokens
each): embeddings (word + absolute position +
token type, then LayerNorm), then per layer bidirectional self-attention within each input,
``LayerNorm(x + attention)``, the GELU MLP and ``LayerNorm(x + mlp)`` (post-norm), as Hugging
Face's ``BertModel`` computes. No KV cache: every input is computed whole in one step (the
scheduler never splits an encoder's prompt: ``PoolingParams.bidirectional``) and nothing is kept.

Linear layers run as the decoder's do on the CPU (kernels/reference.py ``linear``: pre-packed
panels, batch invariant for any row count; otherwise one GEMM per input when the runner asks for
batch invariance), attention as one ``scaled_dot_product_attention`` per input, so an input's
vector never depends on what else is in the step. The same code runs on a GPU (plain torch ops).

A classification head (``classifier``: ``classify`` and ``score`` requests) is the two layers
its config names (``EncoderConfig.head_tensors``): dense + tanh over the first token's final
hidden state, then the classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvflow.kernels import reference as K
from kvflow.kernels.ops import KernelBackend
from kvflow.services.worker.layer_weights import ClassifierHead, EncoderLayer, packer
from kvflow.services.worker.model_interface import (
    BaseModel,
    ForwardBatch,
    KvCaches,
    KvCacheSpec,
    LoadSpec,
)
from kvflow.services.worker.step_inputs import DeviceBatch
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.registry import family

if TYPE_CHECKING:
    from kvflow.services.worker.lora import LoRAStep
    from kvflow.shared.models.families.bert import EncoderConfig  # the encoder kind's config


class EncoderModel(BaseModel):
    """An encoder built from an ``EncoderConfig`` and its BERT-named weights: the ``encoder``
    kind of ``Model`` (services/worker/model_interface.py), pooling only."""

    generates = False  # no logits: pooled vectors (and a classifier's scores) only
    whole_inputs = True  # bidirectional attention: every input whole, nothing kept
    decode_graphs = False

    def __init__(self, cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg: EncoderConfig = cfg
        w = dict(weights)

        def take(name: str) -> torch.Tensor:
            try:
                return w.pop(name)
            except KeyError:
                raise ValueError(f"the {cfg.family} checkpoint has no tensor {name!r}") from None

        def ln(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(f"{name}.weight"), take(f"{name}.bias")

        self.word = take("embeddings.word_embeddings.weight")
        self.position = take("embeddings.position_embeddings.weight")
        self.token_type = w.pop("embeddings.token_type_embeddings.weight", None)
        if self.token_type is not None and self.token_type.shape[0] != cfg.type_vocab_size:
            raise ValueError(
                f"the {cfg.family} checkpoint has {self.token_type.shape[0]} token types; its "
                f"config says type_vocab_size {cfg.type_vocab_size}"
            )
        self.embed_norm = ln("embeddings.LayerNorm")
        self.layers: list[EncoderLayer] = []
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            a = f"{p}attention.self."
            qkv = ("query", "key", "value")
            self.layers.append(
                EncoderLayer(
                    qkv=torch.cat([take(f"{a}{n}.weight") for n in qkv]),
                    qkv_bias=torch.cat([take(f"{a}{n}.bias") for n in qkv]),
                    o=take(f"{p}attention.output.dense.weight"),
                    o_bias=take(f"{p}attention.output.dense.bias"),
                    attn_norm=ln(f"{p}attention.output.LayerNorm"),
                    up=take(f"{p}intermediate.dense.weight"),
                    up_bias=take(f"{p}intermediate.dense.bias"),
                    down=take(f"{p}output.dense.weight"),
                    down_bias=take(f"{p}output.dense.bias"),
                    mlp_norm=ln(f"{p}output.LayerNorm"),
                )
            )
        self.head: ClassifierHead | None = None
        if cfg.head_tensors:
            (dense, dense_bias), (out, out_bias) = (ln(n) for n in cfg.head_tensors)
            self.head = ClassifierHead(dense, dense_bias, out, out_bias)
        # a BertModel's unused pooler, a language-modelling head: not needed for these tasks
        left = sorted(n for n in w if not n.startswith(("pooler.", "lm_head.", "cls.")))
        if left:
            raise ValueError(f"the {cfg.family} checkpoint has unexpected tensors {left[:6]}")

    @classmethod
    def load(cls, src: ModelSource, cfg: EncoderConfig, spec: LoadSpec) -> EncoderModel:
        """The directory's tensors under BERT's names without the base model's prefix (its
        family's ``checkpoint_prefix``), position-id buffers dropped, as ``spec.dtype``."""
        from safetensors.torch import load_file

        if src.kind == "gguf" or spec.quantization:
            raise ValueError(f"{src.path}: encoders load from HF directories, unquantized")
        files = sorted(src.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{src.path}: no safetensors weights")
        prefix = family(cfg.family).checkpoint_prefix
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            for k, v in load_file(str(f)).items():
                if not k.endswith(("position_ids", "token_type_ids")):
                    weights[k.removeprefix(prefix)] = v.to(spec.dtype)
        return cls.from_weights(cfg, weights, spec)

    @classmethod
    def from_weights(
        cls, cfg: EncoderConfig, weights: dict[str, Any], spec: LoadSpec
    ) -> EncoderModel:
        return cls(cfg, {n: w.to(spec.device) for n, w in weights.items()})

    @property
    def dtype(self) -> torch.dtype:
        return self.word.dtype

    @property
    def device(self) -> torch.device:
        return self.word.device

    @property
    def token_types(self) -> int:
        """How many token types the embeddings have (RoBERTa: 1, pairs get none)."""
        return 0 if self.token_type is None else self.token_type.shape[0]

    @property
    def classifier(self) -> Any:  # type: ignore[override]
        return self._classify if self.head is not None else None

    @property
    def score_activation(self) -> str:  # type: ignore[override]
        return self.cfg.score_activation

    def kv_cache_spec(self) -> KvCacheSpec:
        """Nothing kept between steps (the scheduler's blocks only count the tokens in
        flight, as many as the budget would hold as K/V in the model's dtype)."""
        return KvCacheSpec.of(self.cfg, self.dtype, kept=False)

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> str:
        """Pre-pack the layers' linear weights as the decoder does (layer_weights.packer);
        returns the packing's name."""
        pack, packing = packer(dtype)
        for layer in self.layers:
            layer.pack(pack)
        return packing

    def linear_weights(self) -> list[Any]:
        """One linear weight of each distinct shape (batch-invariance calibration)."""
        seen: dict[tuple[int, ...], Any] = {}
        for w in self.layers[0].linears():
            seen.setdefault(tuple(w.shape), w)
        return list(seen.values())

    # -- the two paths ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: KvCaches,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's whole inputs laid end to end (``batch.query_lens`` tokens each): no
        logits, and the final hidden states [P, hidden] (fp32) of ``batch.hidden_rows``.
        With the runner's batch-invariant row layout, each input's GEMMs run on their own
        (where the weights are not batch invariant by construction)."""
        self._no_logits(batch.sample_rows)
        assert batch.query_lens is not None
        lens = batch.query_lens.tolist()
        hidden = self._encode(
            input_ids, positions, batch.token_types, lens, batch.hidden_rows, batch.rows is not None
        )
        return self._logits(), hidden

    @torch.inference_mode()
    def forward_device_pooled(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: KvCaches,
        hidden_rows: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device path: the same plain torch ops on the device (the kernel backend's
        paged attention has nothing to read)."""
        self.refuse_lora(lora)
        self._no_logits(batch.sample_rows)
        n = batch.input_ids.shape[0]
        if batch.query_start_loc is None:  # one token each
            lens = [1] * n
        else:
            starts = batch.query_start_loc.tolist()
            lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        ids, pos = batch.input_ids.long(), batch.positions.long()
        hidden = self._encode(ids, pos, batch.token_types, lens, hidden_rows, False)
        return self._logits(), hidden

    # -- the model ------------------------------------------------------------------------------

    def _no_logits(self, sample_rows: torch.Tensor | None) -> None:
        if sample_rows is None or sample_rows.numel():
            raise ValueError(f"{self.cfg.family} is an encoder: it has no logits to sample")

    def _logits(self) -> torch.Tensor:
        return torch.empty(0, self.cfg.vocab_size, device=self.device)

    def _encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_types: torch.Tensor | None,
        seq_lens: list[int],
        hidden_rows: torch.Tensor | None,
        per_input_gemms: bool,
    ) -> torch.Tensor | None:
        """Final hidden states [P, hidden] (fp32) of ``hidden_rows`` for inputs of
        ``seq_lens`` tokens laid end to end in ``input_ids`` [T] (at ``positions``, with
        ``token_types``). ``per_input_gemms``: one GEMM per input (batch invariance where the
        weights are not panels)."""
        cfg = self.cfg
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        x = self.word[input_ids] + self.position[positions + cfg.position_offset]
        if self.token_type is not None:
            if token_types is None or self.token_types < 2:  # RoBERTa: one type, pairs get none
                x = x + self.token_type[torch.zeros_like(input_ids)]
            else:
                x = x + self.token_type[token_types]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.embed_norm, cfg.rms_norm_eps)
        layout = None
        if per_input_gemms:
            layout = K.RowLayout(0, tuple(zip(starts[:-1], starts[1:], strict=True)))
        for layer in self.layers:
            x = self._layer(layer, x, starts, layout)
        return None if hidden_rows is None else x.index_select(0, hidden_rows).float()

    def _layer(
        self,
        layer: EncoderLayer,
        x: torch.Tensor,
        starts: list[int],
        layout: K.RowLayout | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        h, d = cfg.num_heads, cfg.head_dim
        qkv = K.linear(x, layer.qkv, layout).add_(layer.qkv_bias)
        q, k, v = qkv.view(-1, 3, h, d).unbind(1)
        out = torch.empty(x.shape[0], h, d, dtype=x.dtype, device=x.device)
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            # [1, H, n, D] per input (4-D: torch's fused CPU kernel, 2x its 3-D path): every
            # token attends to every token of its own input
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None],
                k[a:b].transpose(0, 1)[None],
                v[a:b].transpose(0, 1)[None],
            )
            out[a:b] = o[0].transpose(0, 1)
        o = K.linear(out.view(-1, h * d), layer.o, layout).add_(layer.o_bias)
        x = F.layer_norm(o + x, (cfg.hidden_size,), *layer.attn_norm, cfg.rms_norm_eps)
        m = K.linear(x, layer.up, layout).add_(layer.up_bias)
        m = _activation(cfg.hidden_act, m)
        m = K.linear(m, layer.down, layout).add_(layer.down_bias)
        return F.layer_norm(m + x, (cfg.hidden_size,), *layer.mlp_norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [num_labels] (fp32) of one pooled row (the first
        token's final hidden state)."""
        hd = self.head
        assert hd is not None
        x = pooled.to(self.dtype).unsqueeze(0)
        x = torch.tanh(F.linear(x, hd.dense, hd.dense_bias))
        return F.linear(x, hd.out, hd.out_bias)[0].float()


def _activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)
