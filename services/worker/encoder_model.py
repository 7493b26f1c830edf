"""The encoder every encoder family runs (shared/models/families/bert.py: BERT, RoBERTa,
XLM-RoBERTa), over a step of whole inputs laid end to end: embeddings (word + absolute position +
token type, then LayerNorm), then per layer bidirectional self-attention within each input,
``LayerNorm(x + attention)``, the GELU MLP and ``LayerNorm(x + mlp)`` (post-norm), as Hugging
Face's ``BertModel`` computes. No KV cache: every input is computed whole in one step (the
scheduler never splits an encoder's prompt: ``PoolingParams.bidirectional``) and nothing is kept.

Linear layers run as the decoder's do on the CPU (kernels/reference.py ``linear``: pre-packed
panels, batch invariant for any row count; otherwise one GEMM per input when the runner asks for
batch invariance), attention as one ``scaled_dot_product_attention`` per input, so an input's
vector never depends on what else is in the step. The same code runs on a GPU (plain torch ops).

Heads (``classify``): BERT's pooler (dense + tanh over [CLS]) then ``classifier``; RoBERTa's
``classifier.dense`` + tanh then ``classifier.out_proj`` over ``<s>``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvflow.kernels import reference as K
from kvflow.kernels.cpu_gemm import PanelWeight, linear_packing
from kvflow.services.worker.pooling import PoolState, pooled_output
from kvflow.shared.messages import PooledOutput, ScheduledSeq
from kvflow.shared.models.config import ModelConfig

_LINEARS = ("qkv", "o", "up", "down")


class EncoderModel(torch.nn.Module):
    """An encoder built from a ``ModelConfig`` (``encoder``) and its BERT-named weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        w = dict(weights)

        def take(name: str) -> torch.Tensor:
            try:
                return w.pop(name)
            except KeyError:
                raise ValueError(f"the {cfg.family} checkpoint has no tensor {name!r}") from None

        self.word = take("embeddings.word_embeddings.weight")
        self.position = take("embeddings.position_embeddings.weight")
        self.token_type = w.pop("embeddings.token_type_embeddings.weight", None)
        self.embed_norm = self._ln(take, "embeddings.LayerNorm")
        self.layers: list[dict[str, Any]] = []
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            a = f"{p}attention.self."
            self.layers.append(
                {
                    "qkv": torch.cat([take(f"{a}{n}.weight") for n in ("query", "key", "value")]),
                    "qkv_bias": torch.cat(
                        [take(f"{a}{n}.bias") for n in ("query", "key", "value")]
                    ),
                    "o": take(f"{p}attention.output.dense.weight"),
                    "o_bias": take(f"{p}attention.output.dense.bias"),
                    "attn_norm": self._ln(take, f"{p}attention.output.LayerNorm"),
                    "up": take(f"{p}intermediate.dense.weight"),
                    "up_bias": take(f"{p}intermediate.dense.bias"),
                    "down": take(f"{p}output.dense.weight"),
                    "down_bias": take(f"{p}output.dense.bias"),
                    "mlp_norm": self._ln(take, f"{p}output.LayerNorm"),
                }
            )
        self.head: dict[str, torch.Tensor] = {}
        if cfg.classifier == "bert":
            names = ("pooler.dense", "classifier")
        elif cfg.classifier == "roberta":
            names = ("classifier.dense", "classifier.out_proj")
        else:
            names = ()
        for role, name in zip(("dense", "out")[: len(names)], names, strict=True):
            self.head[role] = take(f"{name}.weight")
            self.head[role + "_bias"] = take(f"{name}.bias")
        # a BertModel's unused pooler, a language-modelling head: not needed for these tasks
        left = sorted(n for n in w if not n.startswith(("pooler.", "lm_head.", "cls.")))
        if left:
            raise ValueError(f"the {cfg.family} checkpoint has unexpected tensors {left[:6]}")
        self.invariant_gemm = False  # set by pack_weights: panels are batch invariant by rows

    @staticmethod
    def _ln(take: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return take(f"{name}.weight"), take(f"{name}.bias")

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
    def length_dependent_rope(self) -> bool:
        return False

    @property
    def native_layer_ops(self) -> bool:
        return False

    def use_native_layer_ops(self) -> bool:
        """The decoder's fused C ops do not apply (LayerNorm, no RoPE, no KV writes)."""
        return False

    def make_kv_caches(self, num_blocks: int, block_size: int) -> list[Any]:
        """None: an encoder keeps nothing between steps (the scheduler's blocks only count
        the tokens in flight)."""
        return []

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> str:
        """Pre-pack the layers' linear weights as the decoder does (``DecoderModel.
        pack_weights``); returns the packing's name."""
        pack, packing = linear_packing(dtype)
        for layer in self.layers:
            for name in _LINEARS:
                if isinstance(layer[name], torch.Tensor):
                    layer[name] = pack(layer[name])
        self.invariant_gemm = pack is PanelWeight
        return packing

    def linear_weights(self) -> list[Any]:
        """One linear weight of each distinct shape (batch-invariance calibration)."""
        seen: dict[tuple[int, ...], Any] = {}
        for name in _LINEARS:
            w = self.layers[0][name]
            seen.setdefault(tuple(w.shape), w)
        return list(seen.values())

    @torch.inference_mode()
    def encode(
        self,
        input_ids: torch.Tensor,
        token_types: torch.Tensor,
        seq_lens: list[int],
        hidden_rows: torch.Tensor,
        per_input_gemms: bool = False,
    ) -> torch.Tensor:
        """Final hidden states [P, hidden] (fp32) of ``hidden_rows`` for inputs of
        ``seq_lens`` tokens laid end to end in ``input_ids`` [T] (with ``token_types`` [T]).
        ``per_input_gemms``: one GEMM per input (batch invariance where the weights are not
        panels)."""
        cfg = self.cfg
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(self.device)
        x = self.word[input_ids] + self.position[positions + cfg.position_offset]
        if self.token_type is not None:
            x = x + self.token_type[token_types]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.embed_norm, cfg.rms_norm_eps)
        layout = None
        if per_input_gemms and not self.invariant_gemm:
            layout = K.RowLayout(0, tuple(zip(starts[:-1], starts[1:], strict=True)))
        for layer in self.layers:
            x = self._layer(layer, x, starts, layout)
        return x.index_select(0, hidden_rows).float()

    def _layer(
        self,
        layer: dict[str, Any],
        x: torch.Tensor,
        starts: list[int],
        layout: K.RowLayout | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        h, d = cfg.num_heads, cfg.head_dim
        qkv = K.linear(x, layer["qkv"], layout).add_(layer["qkv_bias"])
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
        o = K.linear(out.view(-1, h * d), layer["o"], layout).add_(layer["o_bias"])
        x = F.layer_norm(o + x, (cfg.hidden_size,), *layer["attn_norm"], cfg.rms_norm_eps)
        m = K.linear(x, layer["up"], layout).add_(layer["up_bias"])
        m = _activation(cfg.hidden_act, m)
        m = K.linear(m, layer["down"], layout).add_(layer["down_bias"])
        return F.layer_norm(m + x, (cfg.hidden_size,), *layer["mlp_norm"], cfg.rms_norm_eps)

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [num_labels] (fp32) of one pooled row (the first
        token's final hidden state)."""
        hd = self.head
        if not hd:
            raise ValueError(f"this {self.cfg.family} checkpoint has no classification head")
        x = pooled.to(self.dtype).unsqueeze(0)
        x = torch.tanh(F.linear(x, hd["dense"], hd["dense_bias"]))
        return F.linear(x, hd["out"], hd["out_bias"])[0].float()


def _activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


def encoder_step(
    model: EncoderModel,
    seqs: list[ScheduledSeq],
    pools: list[PoolState],
    per_input_gemms: bool,
) -> list[PooledOutput]:
    """One step of whole inputs through ``model``: each sequence's pooled output (the
    embedding, class probabilities or score: ``PoolState.finish``), in the plan's order.
    A sequence that is not its whole prompt is refused (ValueError): the scheduler never
    splits an encoder's input."""
    ids: list[int] = []
    types: list[int] = []
    rows: list[int] = []
    lens: list[int] = []
    for s, st in zip(seqs, pools, strict=True):
        n = len(s.token_ids)
        if s.start_pos != 0 or n != st.prompt_len or s.num_draft:
            raise ValueError(
                f"{s.request_id}: an encoder computes a whole input in one step (got tokens "
                f"{s.start_pos}..{s.start_pos + n} of {st.prompt_len})"
            )
        start = st.pooling.pair_start if model.token_types > 1 else 0  # RoBERTa: one type
        types += [0] * n if not start else [0] * start + [1] * (n - start)
        rows += [len(ids) + r for r in st.rows_of(s)]
        ids += s.token_ids
        lens.append(n)
    dev = model.device
    hidden = model.encode(
        torch.tensor(ids, device=dev),
        torch.tensor(types, device=dev),
        lens,
        torch.tensor(rows, device=dev),
        per_input_gemms,
    )
    out: list[PooledOutput] = []
    at = 0
    for s, st in zip(seqs, pools, strict=True):
        k = len(st.rows_of(s))
        st.add(hidden[at : at + k])
        at += k
        vector = st.finish(model.classify if model.head else None, model.cfg.score_activation)
        out.append(pooled_output(s.request_id, vector))
    return out
