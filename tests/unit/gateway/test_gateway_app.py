"""The gateway app with an in-memory stand-in for the bus (no network): failures of the bus or
of the code itself become OpenAI-shaped 503/500 answers, and the app keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

import kvflow.services.gateway.routes.completions as completion_routes
from kvflow.services.gateway.app import create_app
from kvflow.shared import subjects
from kvflow.shared.config import Settings
from tests.helpers.gateway import FakeBus


@pytest.fixture
def bus() -> FakeBus:
    return FakeBus()


@pytest.fixture
def http(bus):
    app = create_app(Settings.of(served_model_name="m"), bus=bus)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


BODY = {"model": "m", "prompt": "hi"}


def test_served_through_the_bus(http, bus) -> None:
    r = http.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ok"
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert [s for s, _ in bus.published] == [subjects.TOKENIZE]  # finished: no Abort


def test_publish_failure_is_503(http, bus) -> None:
    bus.fail_publish = True
    r = http.post("/v1/completions", json=BODY)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    bus.fail_publish = False
    assert http.post("/v1/completions", json=BODY).status_code == 200


def test_disconnected_nats_is_503(http, bus) -> None:
    bus.nc.is_connected = False
    try:
        assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "NATS" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503
    finally:
        bus.nc.is_connected = True


def test_unexpected_errors_are_500_and_the_app_goes_on(http, monkeypatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(completion_routes, "completion_job", boom)
    r = http.post("/v1/completions", json=BODY)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and "boom" in err["message"]
    monkeypatch.undo()
    assert http.post("/v1/completions", json=BODY).status_code == 200


def test_health_without_scheduler_is_503(http) -> None:
    r = http.get("/health")
    assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["m"] and "max_model_len" not in models[0]


def test_each_app_serves_through_its_own_state() -> None:
    """The routes are module-level: two apps in one process reach their own GatewayState (and
    bus) through the request's app, and best_of fans out there (shared/fan_out.py)."""
    buses = [FakeBus(), FakeBus()]
    apps = [
        create_app(Settings.of(served_model_name=m), bus=b)
        for m, b in zip("ab", buses, strict=True)
    ]  # type: ignore[arg-type]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        assert first.get("/v1/models").json()["data"][0]["id"] == "a"
        assert second.get("/v1/models").json()["data"][0]["id"] == "b"
        r = second.post(
            "/v1/completions", json={"model": "b", "prompt": "hi", "n": 2, "best_of": 3}
        )
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert buses[0].published == []
    ids = [msg.request_id for _, msg in buses[1].published]
    assert [i.rsplit("-", 1)[1] for i in ids] == ["0", "1", "2"]
    assert len({i.rsplit("-", 1)[0] for i in ids}) == 1
