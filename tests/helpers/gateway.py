"""Stand-ins on the far side of the gateway: a bus that answers every request in-process (unit
tests), and a scheduler and workers over real NATS (integration tests)."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.messages import (
    Abort,
    Delta,
    DeltaBatch,
    GenerateRequest,
    Ping,
    Pong,
    RequestError,
    SchedulerStats,
    StatsRequest,
)


class _Conn:
    is_connected = True


class FakeBus:
    """Answers every GenerateRequest with one final delta; ``fail_publish`` makes publishing
    raise as nats-py does when the connection is closed."""

    def __init__(self) -> None:
        self.nc = _Conn()
        self.handlers: dict[str, Any] = {}
        self.published: list[tuple[str, Any]] = []
        self.fail_publish = False

    async def subscribe(self, subject: str, handler: Any, queue: str = "") -> Any:
        self.handlers[subject] = handler
        return None

    async def publish(self, subject: str, msg: Any, headers: Any = None) -> None:
        if self.fail_publish:
            raise ConnectionError("nats: connection closed")
        self.published.append((subject, msg))
        if isinstance(msg, GenerateRequest):
            reply = DeltaBatch([Delta(msg.request_id, "ok", 1, "stop", 2, 1)])
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self.handlers[msg.reply_to](reply, None))
            )

    async def request(self, subject: str, msg: Any, timeout: float = 2.0) -> Any:
        raise TimeoutError("nats: timeout")

    async def close(self) -> None:
        pass


MODEL = "kvflow-test"


class StandIn:
    """Answers GenerateRequests like the real pipeline would, steered by the prompt text:
    ``[error429]`` -> RequestError 429, ``[slow]`` -> a delta every 20 ms until aborted,
    ``[hang]`` -> nothing, ``[stall]`` -> one delta then nothing, ``[fail]`` -> a final delta with finish_reason "error",
    anything else -> max_tokens (or 5) tokens "t0 t1 ..." then finish "length"."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests: dict[str, GenerateRequest] = {}
        self.aborts: queue.Queue[str] = queue.Queue()
        self.aborted: set[str] = set()
        self.bus = Bus("stand-in")
        self.stats_sub: Any = None
        self.ping_subs: dict[str, Any] = {}
        self.num_workers = 1

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.call(self._start())

    async def _start(self) -> None:
        await self.bus.connect(self.nats_url)
        await self.bus.subscribe(subjects.TOKENIZE, self._on_generate, queue="tokenizer")
        await self.bus.subscribe(subjects.ABORT, self._on_abort)
        for service in ("tokenizer", "detokenizer"):
            await self._answer_pings(service, True)
        await self.bus.client.flush()

    async def _answer_pings(self, service: str, on: bool) -> None:
        if on and service not in self.ping_subs:
            self.ping_subs[service] = await self.bus.subscribe(
                subjects.ping(service), self._on_ping
            )
        elif not on and service in self.ping_subs:
            await self.ping_subs.pop(service).unsubscribe()
        await self.bus.client.flush()

    async def _on_ping(self, msg: Any, raw: Any) -> None:
        assert isinstance(msg, Ping)
        await self.bus.reply(raw, Pong(raw.subject.rsplit(".", 1)[1], "stand-in"))

    def pings(self, service: str, on: bool) -> None:
        """Answer (or not, as if no ``service`` were there) the gateway's Ping for /health."""
        self.call(self._answer_pings(service, on))

    def stop(self) -> None:
        self.call(self.bus.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def scheduler(self, on: bool, num_workers: int = 1) -> None:
        """Start or stop answering StatsRequest (as a scheduler would)."""
        self.num_workers = num_workers

        async def toggle() -> None:
            if on and self.stats_sub is None:
                self.stats_sub = await self.bus.subscribe(subjects.SCHEDULER_STATS, self._on_stats)
            elif not on and self.stats_sub is not None:
                await self.stats_sub.unsubscribe()
                self.stats_sub = None
            await self.bus.client.flush()

        self.call(toggle())

    async def _on_stats(self, msg: Any, raw: Any) -> None:
        assert isinstance(msg, StatsRequest)
        stats = SchedulerStats(self.num_workers, 100, 100, 0, 0, model=MODEL, max_model_len=2048)
        await self.bus.reply(raw, stats)

    async def _on_abort(self, msg: Any, raw: Any) -> None:
        assert isinstance(msg, Abort)
        self.aborted.add(msg.request_id)
        self.aborts.put(msg.request_id)

    async def _on_generate(self, msg: Any, raw: Any) -> None:
        assert isinstance(msg, GenerateRequest)
        self.requests[msg.request_id] = msg
        asyncio.ensure_future(self._serve(msg))

    async def _serve(self, req: GenerateRequest) -> None:
        text = req.prompt or (req.messages[-1].content if req.messages else "")
        rid, out = req.request_id, req.reply_to
        prompt_tokens = len(text.split()) or len(req.prompt_token_ids or [])
        if "[error429]" in text:
            await self.bus.publish(
                out, RequestError(rid, "queue full", "RateLimitError", None, 429)
            )
            return
        if "[hang]" in text:
            return
        if "[stall]" in text:  # one delta, then silence: only http.disconnect can end it
            await self.bus.publish(out, DeltaBatch([Delta(rid, "t0 ", 1)]))
            return
        if "[fail]" in text:
            await self.bus.publish(out, DeltaBatch([Delta(rid, "t0 ", 1)]))
            await asyncio.sleep(0.01)
            await self.bus.publish(out, DeltaBatch([Delta(rid, "", 0, "error")]))
            return
        n = 1000 if "[slow]" in text else (req.params.max_tokens or 5)
        for i in range(n):
            if rid in self.aborted:
                return
            last = i == n - 1
            delta = Delta(
                rid,
                f"t{i} ",
                1,
                "length" if last else None,
                prompt_tokens if last else 0,
                i + 1 if last else 0,
            )
            # batches also carry deltas of requests this gateway does not know: ignored
            await self.bus.publish(out, DeltaBatch([Delta("other-request", "zz", 1), delta]))
            await asyncio.sleep(0.02 if "[slow]" in text else 0)
