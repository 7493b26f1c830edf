"""Shared fixtures: the real SmolLM2 tokenizer (cached conversion; no network). Also switches
Triton to its interpreter on machines without a GPU (see below)."""

from __future__ import annotations

import os

import torch

# Without a GPU, the Triton kernel tests (tests/kernels/) run in Triton's
# interpreter. triton.jit picks interpreted or compiled when it decorates a function, Triton's own
# standard library included, i.e. when triton is first imported; transformers imports triton, so
# the switch must be set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shared.model_source import load_tokenizer, resolve_model  # noqa: E402


@pytest.fixture(scope="session")
def model_src():
    return resolve_model()


@pytest.fixture(scope="session")
def tokenizer(model_src):
    return load_tokenizer(model_src)
