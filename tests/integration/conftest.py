"""Real nats-server (and redis-server) on free ports for integration tests."""

from __future__ import annotations

import pytest

from kvflow.shared.infra import start_nats


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    try:
        yield server.url
    finally:
        server.stop()
