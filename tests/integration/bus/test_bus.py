"""The bus over a real nats-server: typed round trips, queue groups, bad input survived."""

from __future__ import annotations

import asyncio

from kvflow.shared.bus import Bus
from kvflow.shared.messages import Abort, SchedulerStats, StatsRequest


async def test_publish_subscribe_and_malformed_messages_are_dropped(nats_url) -> None:
    a, b = Bus("a"), Bus("b")
    await b.connect(nats_url)
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, raw) -> None:
        await got.put(msg)

    await b.subscribe("t.x", handler)
    await b.client.flush()  # the subscription reaches the server before a publishes
    # a connects after it: on a just-started nats-server (2.15.1), a connection made before
    # another's SUB lost its first publishes to it in ~4% of runs (measured: 4/100 this way,
    # 0/150 connecting after); later publishes arrive. Submissions are acknowledged and
    # resubmitted for that reason (shared/submission.py); this test is about dropping garbage.
    await a.connect(nats_url)
    await a.client.publish("t.x", b"\xff\x00garbage")
    await a.publish("t.x", Abort("r1"))
    assert await asyncio.wait_for(got.get(), 5) == Abort("r1")
    assert b.dropped_messages == 1
    await a.close()
    await b.close()


async def test_queue_group_delivers_each_message_once(nats_url) -> None:
    pub, w1, w2 = Bus("p"), Bus("w1"), Bus("w2")
    for bus in (pub, w1, w2):
        await bus.connect(nats_url)
    seen: list[str] = []

    async def handler(msg, raw) -> None:
        seen.append(msg.request_id)

    await w1.subscribe("t.q", handler, queue="g")
    await w2.subscribe("t.q", handler, queue="g")
    await w1.client.flush()
    await w2.client.flush()
    for i in range(20):
        await pub.publish("t.q", Abort(f"r{i}"))
    await pub.client.flush()
    await asyncio.sleep(0.3)
    assert sorted(seen) == sorted(f"r{i}" for i in range(20))
    for bus in (pub, w1, w2):
        await bus.close()


async def test_request_reply(nats_url) -> None:
    server, client = Bus("s"), Bus("c")
    await server.connect(nats_url)
    await client.connect(nats_url)

    async def handler(msg, raw) -> None:
        await server.reply(raw, SchedulerStats(1, 10, 9, 1, 0))

    await server.subscribe("t.stats", handler)
    await server.client.flush()
    reply = await client.request("t.stats", StatsRequest())
    assert reply == SchedulerStats(1, 10, 9, 1, 0)
    await server.close()
    await client.close()


async def test_subscribe_returns_once_the_server_has_the_subscription() -> None:
    """A publisher connected before the subscriber publishes the moment ``subscribe`` returns.
    With nats-py's own flush this lost the first message in ~5 % of fresh servers (its PING
    overtakes the buffered SUB); 40 fresh servers make that loss show up here."""
    from kvflow.shared.infra import start_nats

    for attempt in range(40):
        server = start_nats()
        a, b = Bus("a"), Bus("b")
        try:
            await a.connect(server.url)
            await b.connect(server.url)
            got: asyncio.Queue = asyncio.Queue()

            async def handler(msg, raw, got=got) -> None:
                await got.put(msg)

            await b.subscribe("t.first", handler)
            await a.publish("t.first", Abort(f"r{attempt}"))
            assert await asyncio.wait_for(got.get(), 5) == Abort(f"r{attempt}")
        finally:
            await a.close()
            await b.close()
            server.stop()
