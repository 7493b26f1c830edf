"""``cache_salt`` at the edge, offline (the gateway app over an in-memory bus, the tokenizer
service with a stand-in bus, the Python API's prompt dicts): accepted on every generation route
and carried in the GenerateRequest, refused when empty (a 400 naming it, as vLLM), and with
``--cache-salt-per-key`` put behind the API key's tenant id (never the key)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.trace import INVALID_SPAN

from kvflow.llm import LLM
from kvflow.sampling_params import prompt_cache_salt
from kvflow.services.gateway.app import create_app
from kvflow.services.gateway.auth import bearer_token
from kvflow.services.gateway.convert import tenant_salt
from kvflow.services.gateway.keys import key_hash
from kvflow.services.tokenizer.service import TokenizerService
from kvflow.shared.config import Settings
from kvflow.shared.messages import GenerateRequest, SamplingParams, TokenizedRequest
from tests.helpers.gateway import FakeBus

STATIC = "sk-static-unit"
TENANT_KEY = "sk-tenant-a-secret"  # a key the key store would admit, with this hash
BODIES = {
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/generate": {"prompt": "hi"},
}


def gateway(bus: FakeBus, **settings: Any) -> TestClient:
    """The app; with ``api_key`` set, TENANT_KEY is admitted too, as a key store key."""
    app = create_app(Settings.of(served_model_name="m", **settings), bus=bus)  # type: ignore[arg-type]
    auth = app.state.gateway.auth
    check = auth.check

    async def check_with_store(request: Any) -> str | None:
        if auth.enabled and bearer_token(request) == TENANT_KEY:
            return key_hash(TENANT_KEY)
        return await check(request)

    auth.check = check_with_store
    return TestClient(app, raise_server_exceptions=False)


def published_salts(bus: FakeBus) -> list[str | None]:
    salts = [m.cache_salt for _, m in bus.published if isinstance(m, GenerateRequest)]
    bus.published.clear()
    return salts


def post(http: TestClient, route: str, key: str | None = None, **extra: Any) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return http.post(route, json=BODIES[route] | extra, headers=headers)


@pytest.mark.parametrize("route", list(BODIES))
def test_salt_is_accepted_and_carried_on_every_generation_route(route: str) -> None:
    bus = FakeBus()
    with gateway(bus) as http:
        r = post(http, route, cache_salt="s1")
        assert r.status_code == 200, r.text
        assert published_salts(bus) == ["s1"]
        assert post(http, route).status_code == 200
        assert published_salts(bus) == [None]


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_empty_or_non_string_salt_is_a_400_naming_it(route: str, salt: Any) -> None:
    bus = FakeBus()
    with gateway(bus) as http:
        r = post(http, route, cache_salt=salt)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and err["type"] == "BadRequestError", err
        assert err["code"] == 400
        if salt == "":
            assert "non-empty string" in err["message"]
        assert published_salts(bus) == []
    if route == "/generate":  # the beam search path checks it too, before any work
        with gateway(bus) as http:
            r = post(http, route, cache_salt=salt, use_beam_search=True, temperature=0)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_every_sequence_of_a_request_carries_its_salt() -> None:
    bus = FakeBus()
    with gateway(bus) as http:
        body = {"prompt": ["a", "b"], "n": 2, "cache_salt": "s"}
        assert post(http, "/v1/completions", **body).status_code == 200
        assert published_salts(bus) == ["s"] * 4


def test_per_key_salt_puts_the_tenant_in_front_of_the_requests_salt() -> None:
    bus = FakeBus()
    tenant = key_hash(TENANT_KEY)
    with gateway(bus, api_key=STATIC, cache_salt_per_key=True) as http:
        for route in BODIES:
            assert post(http, route, TENANT_KEY).status_code == 200
            assert post(http, route, TENANT_KEY, cache_salt="s").status_code == 200
            assert post(http, route, STATIC).status_code == 200
            assert post(http, route, STATIC, cache_salt="s").status_code == 200
            assert published_salts(bus) == [tenant, f"{tenant}:s", "static", "static:s"]
        assert post(http, "/v1/completions", "sk-wrong").status_code == 401
        r = post(http, "/v1/completions", TENANT_KEY, cache_salt="")
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert published_salts(bus) == []
    assert TENANT_KEY not in tenant  # the key's hash, never the key


def test_without_tenants_requests_keep_their_own_salt() -> None:
    bus = FakeBus()
    with gateway(bus, cache_salt_per_key=True) as http:  # an open API: no tenant
        assert post(http, "/v1/completions").status_code == 200
        assert post(http, "/v1/completions", cache_salt="s").status_code == 200
        assert published_salts(bus) == [None, "s"]
    with gateway(bus, api_key=STATIC) as http:  # keys, but the setting off
        assert post(http, "/v1/completions", TENANT_KEY).status_code == 200
        assert post(http, "/v1/completions", STATIC, cache_salt="s").status_code == 200
        assert published_salts(bus) == [None, "s"]


def test_no_client_salt_reaches_another_tenants_blocks() -> None:
    """Tenant ids (hex hashes, "static") hold no ':', so "<tenant>:<salt>" equals another
    tenant's salt only if the tenants are the same."""
    a, b = key_hash("sk-a"), key_hash("sk-b")
    mine = {tenant_salt(a, s) for s in (None, "x", b, f"{b}:x", "static", ":", "")}
    theirs = {tenant_salt(t, s) for t in (b, "static") for s in (None, "x", a, f"{a}:x", ":")}
    assert mine.isdisjoint(theirs)
    assert tenant_salt(None, "x") == "x" and tenant_salt(None, None) is None


class _Bus:
    def __init__(self) -> None:
        self.published: list[Any] = []

    async def publish(self, subject: str, msg: Any, headers: Any = None) -> None:
        self.published.append(msg)


def test_tokenizer_passes_the_salt_on_to_the_scheduler(tokenizer) -> None:
    svc = TokenizerService(Settings(), tokenizer, 2048, [2])
    svc.bus = _Bus()  # type: ignore[assignment]
    for salt in ("t:s", None):
        gen = GenerateRequest("r", "inbox", SamplingParams(max_tokens=4), "hi", cache_salt=salt)
        assert asyncio.run(svc._tokenize(gen, INVALID_SPAN)) == "ok"
        [out] = svc.bus.published
        assert isinstance(out, TokenizedRequest) and out.cache_salt == salt
        svc.bus.published.clear()


def test_python_api_reads_the_salt_of_dict_prompts(tokenizer) -> None:
    llm = SimpleNamespace(tokenizer=tokenizer)  # _tokenize needs only the tokenizer
    ids = list(tokenizer("hi")["input_ids"])
    assert LLM._tokenize(llm, {"prompt": "hi", "cache_salt": "s"}) == ("hi", ids, "s")
    assert LLM._tokenize(llm, {"prompt_token_ids": [5], "cache_salt": "s"}) == (None, [5], "s")
    assert LLM._tokenize(llm, "hi") == ("hi", ids, None)
    assert prompt_cache_salt({"prompt": "hi", "cache_salt": "s"}) == "s"
    assert prompt_cache_salt({"prompt_token_ids": [1], "cache_salt": "s"}) == "s"
    assert prompt_cache_salt({"prompt": "hi"}) is None
    assert prompt_cache_salt("hi") is None and prompt_cache_salt([1, 2]) is None
    for bad in ("", 3):
        with pytest.raises(ValueError, match="cache_salt"):
            prompt_cache_salt({"prompt": "hi", "cache_salt": bad})
