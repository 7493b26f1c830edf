"""The services that never run the model start without torch: the scheduler, the tokenizer, the
detokenizer, the gateway and ``kvflow serve``'s launcher read the model's config from its header
(shared/model_config.py) and load its saved tokenizer by class (shared/model_source.py). torch
costs each such process ~2 s of CPU and ~200 MB at start; a stack starts five of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.shared.model_source import load_tokenizer, resolve_model
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

_PROBE = """
import json, sys
import kvflow.cli.launcher, kvflow.services.gateway.app
import kvflow.services.scheduler.service, kvflow.services.tokenizer.service, kvflow.services.detokenizer.service
from kvflow.shared.config import Settings
from kvflow.shared.model_config import check_model
from kvflow.shared.model_source import load_tokenizer, resolve_model

cfg = check_model(sys.argv[1])
tok = load_tokenizer(resolve_model(sys.argv[1]), Settings.from_env().ops.cache_root())
print(json.dumps({
    "torch": "torch" in sys.modules,
    "layers": cfg.num_layers,
    "ids": tok("Hello, world!")["input_ids"],
    "chat": tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ),
}))
"""


def _probe(model: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, model], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False, "a torch import crept into a service that does not run the model"
    return got


def _assert_same_tokenizer(got: dict, tok) -> None:  # noqa: ANN001 - a transformers tokenizer
    assert got["ids"] == tok("Hello, world!")["input_ids"]
    assert got["chat"] == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_a_gguf_s_config_and_saved_tokenizer_load_without_torch(kvflow_cache: Path) -> None:
    from transformers import AutoTokenizer

    src = resolve_model()
    load_tokenizer(src, kvflow_cache)  # converts the GGUF's tokenizer once and saves it, if not yet
    got = _probe("")
    assert got["layers"] == 30  # SmolLM2-135M
    # the same tokenizer as transformers' own conversion of the GGUF's
    _assert_same_tokenizer(
        got, AutoTokenizer.from_pretrained(str(src.directory), gguf_file=src.path.name)
    )


def test_a_directory_s_config_and_saved_tokenizer_load_without_torch(
    tokenizer, tmp_path: Path, kvflow_cache: Path
) -> None:
    from transformers import AutoTokenizer

    from tests.helpers.families import CONFIGS

    path = tmp_path / "qwen2"
    CONFIGS["qwen2"]().save_pretrained(
        path
    )  # a model type whose tokenizer class AutoTokenizer picks
    tokenizer.save_pretrained(path)
    load_tokenizer(resolve_model(str(path)), kvflow_cache)  # AutoTokenizer, then saved
    got = _probe(str(path))
    assert got["layers"] == 2
    _assert_same_tokenizer(got, AutoTokenizer.from_pretrained(str(path)))
