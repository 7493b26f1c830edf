"""Encoders: BERT and RoBERTa / XLM-RoBERTa (vLLM's pooling models). Bidirectional attention over
each whole input, learned absolute positions (RoBERTa's start after its padding index), token
types, LayerNorm after each block (post-norm), GELU MLP, biases everywhere; no KV cache and no
decoding (services/worker/encoder_model.py runs them). Heads: none (``BertModel``: embeddings),
or a sequence classifier: BERT's pooler (dense + tanh over [CLS]) and ``classifier``, RoBERTa's
``classifier.dense`` + tanh and ``classifier.out_proj`` over ``<s>``.

Their weights keep Hugging Face's BERT names without the ``bert.`` / ``roberta.`` prefix
(``embeddings.word_embeddings.weight``, ``encoder.layer.N.attention.self.query.weight``, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.shared.models.config import ConfigReader, ModelConfig, activation
from kvflow.shared.models.family import Family

HEAD_TENSORS = {
    "bert": ("pooler.dense", "classifier"),
    "roberta": ("classifier.dense", "classifier.out_proj"),
}
"""A classification head's two layers (dense + tanh, then the classes) by its kind."""


@dataclass(frozen=True)
class EncoderConfig(ModelConfig):
    """An encoder's config: what every model has (``ModelConfig``) and what only the encoder
    reads."""

    type_vocab_size: int = 2  # token-type embeddings (BERT: 2; RoBERTa: 1)
    position_offset: int = 0  # absolute positions start here (RoBERTa: padding_idx + 1)
    classifier: str = ""  # a classification head's kind: "bert" | "roberta" (HEAD_TENSORS)
    score_activation: str = "sigmoid"  # a one-label head's score: "sigmoid" | "identity"

    @property
    def head_tensors(self) -> tuple[str, ...]:
        """The names of the classification head's layers, () without a head."""
        return HEAD_TENSORS.get(self.classifier, ())


_CLASSIFIERS = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
}
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def _head(r: ConfigReader) -> dict[str, Any]:
    """The classification head of ``architectures``: its kind, classes and score activation."""
    archs = r.get("architectures") or []
    kind = next((_CLASSIFIERS[a] for a in archs if a in _CLASSIFIERS), "")
    if not kind:
        return {}
    labels = r.get("id2label")
    n = len(labels) if labels else int(r.get("num_labels", 2))
    st = r.get("sentence_transformers") or {}
    fn = st.get("activation_fn", "torch.nn.modules.activation.Sigmoid") if n == 1 else ""
    if fn and fn not in _ACTIVATIONS:
        raise r.refuse("sentence_transformers", f"activation_fn {fn!r} is not supported")
    return {
        "classifier": kind,
        "num_labels": n,
        "score_activation": _ACTIVATIONS.get(fn, "sigmoid"),
    }


def read_encoder(r: ConfigReader, position_offset: int) -> dict[str, Any]:
    for key in ("is_decoder", "add_cross_attention"):
        if r.get(key, False):
            raise r.refuse(key, "only the encoder (bidirectional, no cross-attention) is served")
    kind = r.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise r.refuse("position_embedding_type", "only absolute positions are supported")
    positions = int(r.get("max_position_embeddings", 512))
    return {
        "hidden_act": activation(r, "hidden_act"),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "rms_norm_eps": float(r.get("layer_norm_eps", 1e-12)),
        "norm_kind": "layer",
        "norm_layout": "post",
        "gated_mlp": False,
        "type_vocab_size": int(r.get("type_vocab_size", 2)),
        "position_offset": position_offset,
        "max_position_embeddings": positions - position_offset,
        "rope_theta": 0.0,  # no rotary embedding
        **_head(r),
    }


def read_bert(r: ConfigReader) -> dict[str, Any]:
    return read_encoder(r, 0)


def read_roberta(r: ConfigReader) -> dict[str, Any]:
    """RoBERTa numbers positions from ``padding_idx + 1`` (its pad token id)."""
    return read_encoder(r, int(r.get("pad_token_id", 1)) + 1)


_IGNORED = frozenset(
    {"hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
     "gradient_checkpointing", "layer_norm_eps", "num_labels"}
)  # fmt: skip

# why neither tensor parallelism nor LoRA adapters are
SMALL = "for encoders: they are small: serve one per worker, and scale workers"

FAMILIES = (
    Family(
        "bert",
        ("BertModel", "BertForSequenceClassification"),
        ("bert",),
        read_bert,
        {},
        checkpoint_prefix="bert.",
        ignored=_IGNORED,
        config=EncoderConfig,
        kind="encoder",
        bidirectional=True,
        no_tensor_parallel=SMALL,
        no_lora=SMALL,
    ),
    Family(
        "roberta",
        (
            "RobertaModel",
            "RobertaForSequenceClassification",
            "XLMRobertaModel",
            "XLMRobertaForSequenceClassification",
        ),
        ("roberta", "xlm-roberta"),
        read_roberta,
        {},
        checkpoint_prefix="roberta.",
        ignored=_IGNORED,
        config=EncoderConfig,
        kind="encoder",
        bidirectional=True,
        no_tensor_parallel=SMALL,
        no_lora=SMALL,
    ),
)
