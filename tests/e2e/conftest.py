"""The session's stacks (tests/helpers/stack.py starts them), and SmolLM2 in transformers."""

from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.stack import GUARDED_KEY, openai_client, running_stack, wait_for_stopping_stacks
from tests.helpers.worker_schedule import OWN_STACKS

SESSION_STACKS = frozenset({"stack", "small_stack", "guarded_stack"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module in tests/helpers/worker_schedule.py's OWN_STACKS may run in the other worker, beside the
    session's stacks: one of them used there would start a second copy under the same name (the
    log that stack_urls reads). Refused before anything starts."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        used = SESSION_STACKS.intersection(getattr(item, "fixturenames", ()))
        if module in OWN_STACKS and used:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session's {', '.join(sorted(used))}: take {module} out "
                "of OWN_STACKS in tests/helpers/worker_schedule.py (it then runs with the session's stacks)"
            )


@pytest.fixture(scope="session", autouse=True)
def _stacks_stop_together():
    """Set up before every stack, so torn down after them all: waits for the stacks still
    stopping."""
    yield
    wait_for_stopping_stacks()


@pytest.fixture(scope="session")
def stack():
    """The default configuration (as `make serve` runs it), with a 2,048-token context."""
    with running_stack("default", "--max-model-len", "2048", "--max-num-seqs", "32") as base:
        yield base


@pytest.fixture(scope="session")
def small_stack():
    """A constrained configuration: 256-token step budget (chunked prefill) and a KV cache of
    160 blocks x 16 tokens, too small for many long sequences at once (preemption); streamed
    output goes 3 tokens per delta (--stream-interval 3), so every output compared with the
    default stack's also checks that nothing is lost or repeated in the merged deltas."""
    args = ["--max-num-batched-tokens", "256", "--num-kv-blocks", "160", "--max-model-len", "2048"]
    args += ["--stream-interval", "3"]
    with running_stack("small", *args) as base:
        yield base


@pytest.fixture(scope="session")
def client(stack):
    return openai_client(stack)


@pytest.fixture(scope="session")
def guarded_stack():
    """API keys on (the static --api-key and keys in the stack's own Redis), a short
    --request-timeout and a 64 KiB body limit: yields (base URL, the stack's Redis URL)."""
    args = ["--api-key", GUARDED_KEY, "--key-store", "redis", "--request-timeout", "5"]
    args += ["--max-body-bytes", "65536"]
    with running_stack("guarded", "--max-model-len", "2048", *args) as base:
        log = (ROOT / ".pytest_cache" / "kvflow-serve-guarded.log").read_text()
        # `kvflow serve` prints the URLs of the nats-server and redis-server it started
        redis_url = log.split(", redis ", 1)[1].split()[0]
        yield base, redis_url


@pytest.fixture(scope="session")
def hf_model(model_src):
    """SmolLM2 in Hugging Face transformers, from the same GGUF file (dequantized to fp32)."""
    import torch

    from tests.helpers.gguf_without_vocabulary import transformers_model

    return transformers_model(model_src.path, torch.float32)
