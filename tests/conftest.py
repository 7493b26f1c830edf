"""Shared fixtures: the real SmolLM2 tokenizer (cached conversion; no network)."""

from __future__ import annotations

import pytest

from shared.model_source import load_tokenizer, resolve_model


@pytest.fixture(scope="session")
def model_src():
    return resolve_model()


@pytest.fixture(scope="session")
def tokenizer(model_src):
    return load_tokenizer(model_src)
