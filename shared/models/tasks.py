"""What a served model is for (vLLM's ``--task``): ``generate`` (a causal LM: completions, chat;
/v1/embeddings pools its hidden states too), ``embed`` (an embedding model: /v1/embeddings,
and /score and /rerank as the cosine of two embeddings), ``classify`` (a
``*ForSequenceClassification`` model: /classify's class probabilities) or ``score`` (a
cross-encoder, a classifier with one label: /score, /rerank and /classify).

``served_task`` resolves ``--task`` (``auto``: from the checkpoint) against what the checkpoint
has, refusing what it cannot do before anything starts; ``task_error`` is the 400 a request for
another task gets. The embed pooling defaults to the checkpoint's sentence-transformers
configuration (``modules.json`` and its Pooling module's ``config.json``: mean, CLS or last
token), else CLS for an encoder and LAST for a decoder, as vLLM does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.shared.models.config import ModelConfig, ModelConfigError
from kvflow.shared.models.registry import family

TASKS = ("generate", "embed", "classify", "score")

API_TASKS = {
    "generate": ("generate",),
    "embed": ("embed", "generate"),  # /v1/embeddings: an embedding model, or a decoder's states
    "classify": ("classify", "score"),
    "score": ("score", "embed"),  # a cross-encoder, or the cosine of two embeddings
}
"""An API's kind of work -> the served tasks that do it."""

_ST_POOLING = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True)
class ServedTask:
    """The served model's task, its embed pooling, and a classifier's labels."""

    task: str
    pooling_type: str  # embed: LAST | MEAN | CLS
    labels: tuple[str, ...] = ()
    encoder: bool = False

    def head_pooling(self) -> str:
        """The row a classification head reads: the first token's ([CLS], <s>) in an encoder,
        the last one's in a decoder."""
        return "CLS" if self.encoder else "LAST"


def _raw_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def st_pooling(path: Path) -> str:
    """The pooling of a sentence-transformers directory (its Pooling module's config), or ''."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return ""
    for m in modules:
        if str(m.get("type", "")).endswith("models.Pooling"):
            try:
                conf = json.loads((path / m.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                return ""
            for key, kind in _ST_POOLING.items():
                if conf.get(key):
                    return kind
            modes = [k for k, v in conf.items() if k.startswith("pooling_mode") and v]
            raise ModelConfigError(
                f"{path}/modules.json: pooling {modes or conf} is not supported (mean, CLS or "
                "last token)"
            )
    return ""


def st_max_seq_length(path: Path) -> int:
    """sentence-transformers' ``max_seq_length`` (what it truncates inputs to), or 0."""
    try:
        conf = json.loads((path / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(conf.get("max_seq_length") or 0)


def labels_of(raw: dict[str, Any], num_labels: int) -> tuple[str, ...]:
    """A classifier's class names by index (``id2label``; ``LABEL_i`` where it has none)."""
    names = raw.get("id2label") or {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(num_labels))


def served_task(
    cfg: ModelConfig, path: Path | None, asked: str = "auto", pooling_type: str = ""
) -> ServedTask:
    """``--task`` resolved for the model of ``cfg`` (HF directory ``path``; None: a GGUF
    file); ModelConfigError says what the checkpoint cannot do."""
    raw = _raw_config(path) if path is not None else {}
    st = st_pooling(path) if path is not None else ""
    heads = cfg.num_labels
    encoder = family(cfg.family).bidirectional
    where = str(path or "the model")
    if asked == "auto":
        if heads:
            asked = "score" if heads == 1 else "classify"
        elif encoder or st:
            asked = "embed"
        else:
            asked = "generate"
    if asked == "reward":
        raise ModelConfigError(
            "--task reward (per-token rewards) is not served; a reward model with a "
            "sequence-classification head is served with --task classify or score"
        )
    if asked not in TASKS:
        raise ModelConfigError(f"--task must be auto or one of {', '.join(TASKS)}")
    if asked == "generate" and encoder:
        raise ModelConfigError(
            f"{where}: {cfg.family} is an encoder: it serves --task embed, classify or score, "
            "not generate"
        )
    if asked in ("classify", "score") and not heads:
        raise ModelConfigError(
            f"{where}: --task {asked} needs a sequence-classification head "
            "(*ForSequenceClassification); this checkpoint has none: serve it with --task embed"
        )
    if asked == "score" and heads != 1:
        raise ModelConfigError(
            f"{where}: --task score needs a cross-encoder (a classifier with one label); this "
            f"one has {heads}: serve it with --task classify"
        )
    pooling = pooling_type or st or ("CLS" if encoder else "LAST")
    return ServedTask(asked, pooling, labels_of(raw, heads), encoder)


def task_error(served: str, api: str, route: str) -> str | None:
    """The 400 message for ``route`` (an API of kind ``api``, ``API_TASKS``' keys) when the
    model serves ``served``; None when it may."""
    if served in API_TASKS[api]:
        return None
    return (
        f"{route} is not served by this model: it is served for --task {served}, and {route} "
        f"needs a model served for --task {' or '.join(API_TASKS[api])}"
    )
