"""The LoRA adapter registry over a real NATS and Redis: the gateway's requests reach the leading
scheduler, which has every worker check an adapter before it exists (a worker's refusal is the
answer, and nothing changes), unloads tell the workers, and a scheduler that takes over (with
the lease in Redis) or restarts alone (``--redis-url``) serves the adapters loaded before."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.lora import GatewayLoras
from kvflow.services.scheduler.lease import Lease
from kvflow.services.scheduler.service import SchedulerService
from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.infra import start_redis
from kvflow.shared.messages import (
    LoraAdapters,
    LoraList,
    LoraLoad,
    LoRARef,
    LoraUnload,
    WorkerHeartbeat,
)


class FakeWorker:
    """A worker's answers to the scheduler's LoRA messages: it refuses paths with "bad"."""

    def __init__(self, bus: Bus, worker_id: str) -> None:
        self.bus, self.worker_id = bus, worker_id
        self.step_subject = subjects.worker_step(worker_id)
        self.checked: list[str] = []
        self.forgotten: list[str] = []

    async def start(self) -> None:
        await self.bus.subscribe(self.step_subject, self.on_message)
        await self.beat()

    async def beat(self) -> None:
        hb = WorkerHeartbeat(self.worker_id, "both", 16, 16, "m", self.step_subject)
        await self.bus.publish(subjects.HEARTBEAT, hb)

    async def on_message(self, msg, raw) -> None:  # noqa: ANN001
        if isinstance(msg, LoraLoad):
            self.checked.append(msg.name)
            err = "cannot be read" if "bad" in msg.path else ""
            await self.bus.reply(raw, LoraAdapters(error=err, code=400, param="lora_path"))
        elif isinstance(msg, LoraUnload):
            self.forgotten.append(msg.name)


async def _until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_load_check_unload_and_takeover(nats_url: str) -> None:
    rds = start_redis()
    settings = Settings.of(
        nats_url=nats_url, enable_lora=True, max_loras=2, lora_modules="sql=/adapters/sql"
    )
    services: list[SchedulerService] = []
    bus = Bus("test-gateway")
    await bus.connect(nats_url)
    workers = [FakeWorker(bus, "w1"), FakeWorker(bus, "w2")]
    try:
        first = SchedulerService(settings, "m", 2048, Lease(rds.url, "m"), "s1")
        services.append(first)
        await first.start()
        await _until(lambda: first.leadership.leading)
        for w in workers:
            await w.start()
        await _until(lambda: len(first.core.workers) == 2)
        gw = GatewayLoras(settings, "m")
        assert await gw.resolve(bus, "sql") == ("sql", LoRARef("sql", 1, "/adapters/sql"))
        got = await gw.call(bus, LoraLoad("chat", "/adapters/chat"))
        assert [a.name for a in got.adapters] == ["sql", "chat"]
        assert all(w.checked == ["chat"] for w in workers)  # both checked it first
        with pytest.raises(APIError) as e:
            await gw.call(bus, LoraLoad("broken", "/adapters/bad"))
        assert e.value.status == 400 and "cannot be read" in e.value.message
        assert e.value.param == "lora_path"
        assert [a.name for a in (await gw.call(bus, LoraList())).adapters] == ["sql", "chat"]
        await gw.call(bus, LoraLoad("tmp", "/adapters/tmp"))
        await gw.call(bus, LoraUnload("tmp"))
        await _until(lambda: all(w.forgotten == ["tmp"] for w in workers))
        assert gw.known.keys() == {"sql", "chat"}
        # the leader goes; a new scheduler takes the lease and knows "chat" (from Redis), and
        # numbers the next adapter after the ones it knows
        first.begin_drain()
        await _until(lambda: first.stopped.is_set())
        await first.close()
        services.remove(first)
        second = SchedulerService(settings, "m", 2048, Lease(rds.url, "m"), "s2")
        services.append(second)
        await second.start()
        await _until(lambda: second.leadership.leading)
        assert second.lora_control.registry.adapters["chat"] == LoRARef("chat", 2, "/adapters/chat")
        for w in workers:
            await w.beat()
        await _until(lambda: len(second.core.workers) == 2)
        got = await gw.call(bus, LoraLoad("new", "/adapters/new"))
        assert {a.name: a.id for a in got.adapters} == {"sql": 1, "chat": 2, "new": 3}
        assert all(w.checked[-1] == "new" for w in workers)
        # a lone scheduler (no lease) restarted on the same Redis (--redis-url) knows them too
        second.begin_drain()
        await _until(lambda: second.stopped.is_set())
        await second.close()
        services.remove(second)
        lone = SchedulerService(settings.replace(redis_url=rds.url), "m", 2048, None, "s3")
        services.append(lone)
        await lone.start()
        assert lone.leadership.leading
        assert set(lone.lora_control.registry.adapters) == {"sql", "chat", "new"}
    finally:
        for s in services:
            s.stopped.set()
            await s.close()
        await bus.close()
        rds.stop()
