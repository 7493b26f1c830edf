"""A model's tokenizer is loaded by transformers' AutoTokenizer once, saved, and later loaded
by the class AutoTokenizer picked (shared/model_source.py ``load_tokenizer``): the saved one
must be the same tokenizer for every family's directory (a config.json whose model type can
change AutoTokenizer's choice of class) and for a WordPiece encoder's (all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvflow.shared import model_source
from kvflow.shared.model_source import load_tokenizer, resolve_model
from tests.helpers.families import CONFIGS, TRANSFORMERS_ONLY
from tests.helpers.pooling import minilm_dir

TEXTS = [
    "Hello, world! <|im_start|>user\nünïcödé   spaces\n\ttabs 12345",
    "  leading spaces and a trailing one ",
    "def f(x):\n    return x ** 2  # 😀 emoji",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]


@pytest.fixture
def own_cache(tmp_path: Path) -> Path:
    """A machine cache of the test's own (nothing saved before it)."""
    return tmp_path / "cache"


def _same(a, b) -> None:  # noqa: ANN001 - two transformers tokenizers
    assert type(a) is type(b)
    assert len(a) == len(b) and a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    for text in TEXTS:
        for special in (True, False):
            ids = a(text, add_special_tokens=special)["input_ids"]
            assert ids == b(text, add_special_tokens=special)["input_ids"], text
            assert a.decode(ids) == b.decode(ids)
            assert a.decode(ids, skip_special_tokens=True) == b.decode(
                ids, skip_special_tokens=True
            )
    assert a.chat_template == b.chat_template
    if a.chat_template:
        assert a.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=True
        ) == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


# (a family's config, the tokenizer class its checkpoints name): what AutoTokenizer decides on
# (the model type can override the named class, a ByteLevel tokenizer.json can too)
CASES = [
    ("llama3", "PreTrainedTokenizerFast"),
    ("mistral", "LlamaTokenizerFast"),
    ("phi3", "LlamaTokenizer"),
    ("qwen2", "Qwen2TokenizerFast"),
    ("qwen3_moe", "Qwen2Tokenizer"),
    ("gemma2", "GemmaTokenizerFast"),
    ("gpt_neox", "GPTNeoXTokenizerFast"),
    ("starcoder2", "GPT2TokenizerFast"),
    ("olmo2", "TokenizersBackend"),
]


@pytest.mark.parametrize(("family", "named"), CASES)
def test_a_checkpoint_s_saved_tokenizer_is_autotokenizer_s(
    family: str, named: str, tokenizer, tmp_path: Path, own_cache: Path
) -> None:
    path = tmp_path / family
    (CONFIGS | TRANSFORMERS_ONLY)[family]().save_pretrained(path)
    tokenizer.save_pretrained(path)  # SmolLM2's tokenizer.json, under the class named
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": named}))
    src = resolve_model(str(path))
    first = load_tokenizer(src, own_cache)  # AutoTokenizer, then saved
    assert (model_source._tokenizer_cache_dir(src, own_cache) / "tokenizer.json").is_file()
    again = load_tokenizer(src, own_cache)  # the saved one, by its class
    reference = AutoTokenizer.from_pretrained(str(path))
    _same(first, reference)
    _same(again, reference)


def test_a_wordpiece_encoder_s_saved_tokenizer_is_autotokenizer_s(
    tmp_path: Path, own_cache: Path
) -> None:
    path = minilm_dir(tmp_path)
    src = resolve_model(str(path))
    load_tokenizer(src, own_cache)
    again = load_tokenizer(src, own_cache)
    _same(again, AutoTokenizer.from_pretrained(str(path)))


def test_an_edited_tokenizer_is_loaded_anew(tokenizer, tmp_path: Path, own_cache: Path) -> None:
    path = tmp_path / "model"
    CONFIGS["llama3"]().save_pretrained(path)
    tokenizer.save_pretrained(path)
    src = resolve_model(str(path))
    first = load_tokenizer(src, own_cache)
    assert first.apply_chat_template(CHAT, tokenize=False).startswith("<|im_start|>")
    template = path / "chat_template.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    os.utime(template, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert load_tokenizer(src, own_cache).apply_chat_template(CHAT, tokenize=False) == (
        "[Be brief.][What is 2 + 2?]"
    )


def test_only_the_most_recently_used_saved_tokenizers_are_kept(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"t{i}").mkdir()
        os.utime(tmp_path / f"t{i}", (1000 + i, 1000 + i))
    os.utime(tmp_path / "t0", (2000, 2000))  # t0 was used last
    model_source._prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t0", "t4"]
