"""Messages over the NATS server's max_payload (shared/large_messages.py) on a real nats-server
whose limit is lowered to 64 KiB: a long prompt reaches exactly one member of a queue group
whole and in order, request and reply both ways, a lost sender's message is dropped and counted
without stopping the subscription, and the envelope's header never reaches a handler."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.shared.bus import Bus
from kvflow.shared.infra import start_nats
from kvflow.shared.large_messages import BLOB_HEADER
from kvflow.shared.messages import Abort, GenerateRequest, SamplingParams

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small_nats():
    server = start_nats(max_payload=LIMIT)
    try:
        yield server.url
    finally:
        server.stop()


def _prompt(n: int) -> GenerateRequest:
    text = "".join(chr(0x41 + i % 26) for i in range(n))
    return GenerateRequest("big", "kvflow.gateway.g", SamplingParams(), prompt=text)


async def _buses(url: str, *names: str) -> list[Bus]:
    out = []
    for name in names:
        bus = Bus(name)
        await bus.connect(url)
        out.append(bus)
    return out


async def test_a_long_prompt_reaches_one_queue_member_whole_and_in_order(small_nats) -> None:
    w1, w2, pub = await _buses(small_nats, "w1", "w2", "pub")
    assert pub.client.max_payload == LIMIT  # read from the server at connect
    got: list[tuple[str, object, dict | None]] = []

    def handler(name: str):
        async def on(msg, raw) -> None:
            got.append((name, msg, raw.headers))

        return on

    await w1.subscribe("t.big", handler("w1"), queue="g")
    await w2.subscribe("t.big", handler("w2"), queue="g")
    big = _prompt(1_000_000)  # ~15 times the server's limit
    for i in range(3):
        await pub.publish("t.big", big, headers={"traceparent": f"00-{i}"})
        await pub.publish("t.big", Abort(f"after-{i}"))
    for _ in range(100):
        if len(got) == 6:
            break
        await asyncio.sleep(0.05)
    assert len(got) == 6
    assert sum(isinstance(m, GenerateRequest) and m == big for _, m, _ in got) == 3

    def seq(m, headers) -> int:  # the publishing order: big-0, after-0, big-1, after-1, ...
        if isinstance(m, GenerateRequest):
            return 2 * int(headers["traceparent"].split("-")[1])
        return 2 * int(m.request_id.split("-")[1]) + 1

    for name in ("w1", "w2"):  # each member gets its messages in publishing order
        mine = [seq(m, h) for n, m, h in got if n == name]
        assert mine == sorted(mine), (name, mine)
    for _, m, headers in got:
        if isinstance(m, GenerateRequest):
            assert BLOB_HEADER not in headers and headers["traceparent"].startswith("00-")
    assert pub.large.sent == 3 and w1.large.fetched + w2.large.fetched == 3
    for bus in (w1, w2, pub):
        await bus.close()


async def test_large_request_and_large_reply(small_nats) -> None:
    server, client = await _buses(small_nats, "s", "c")

    async def answer(msg, raw) -> None:
        await server.reply(raw, Abort("x" * 300_000 + msg.prompt[:10]))

    await server.subscribe("t.rpc", answer)
    reply = await client.request("t.rpc", _prompt(500_000), timeout=10)
    assert reply == Abort("x" * 300_000 + "ABCDEFGHIJ")
    assert client.large.sent == 1 and server.large.sent == 1
    assert server.large.fetched == 1 and client.large.fetched == 1
    await server.close()
    await client.close()


async def test_a_lost_large_message_is_dropped_and_the_subscription_goes_on(small_nats) -> None:
    sub, pub = await _buses(small_nats, "sub", "pub")
    got: asyncio.Queue = asyncio.Queue()

    async def on(msg, raw) -> None:
        await got.put(msg)

    await sub.subscribe("t.lost", on)
    # an envelope whose sender is gone (nobody serves its blob subject)
    gone = f"{pub.large.subject}-gone deadbeef {200_000} {LIMIT - 4096}"
    await pub.client.publish("t.lost", b"", headers={BLOB_HEADER: gone})
    await pub.client.publish("t.lost", b"", headers={BLOB_HEADER: "malformed"})
    await pub.publish("t.lost", Abort("next"))
    assert await asyncio.wait_for(got.get(), 30) == Abort("next")
    assert sub.dropped_messages == 2 and sub.large.failed == 2
    await sub.close()
    await pub.close()
