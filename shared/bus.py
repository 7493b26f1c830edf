"""A thin typed layer over nats-py: connect (with reconnect), publish/subscribe kvflow messages,
queue groups, request/reply, headers. Handlers receive decoded messages; a message that does not
decode is logged, counted and dropped, so no service dies on bad input. Every message in and out
is counted with its bytes per subject (``traffic``, shown as metrics by shared/metrics.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.messages import Message, decode, encode
from shared.subjects import subject_label

log = logging.getLogger("kvflow.bus")

Handler = Callable[[Message, Msg], Awaitable[None]]


class Bus:
    """One NATS connection of a service."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nc: Client | None = None
        self.dropped_messages = 0  # undecodable or failing messages (logged, then dropped)
        # (subject label, "in" | "out") -> [messages, bytes]; plain ints, read at scrape time
        self.traffic: dict[tuple[str, str], list[int]] = {}
        self.subscriptions: list[tuple[str, Subscription]] = []  # (subject label, sub)
        self._labels: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    async def connect(self, url: str, connect_timeout: float = 30.0) -> None:
        """Connect, retrying until ``connect_timeout``; afterwards nats-py reconnects on its own
        for ever (a NATS outage pauses a service, it does not end it)."""

        async def on_error(e: Exception) -> None:
            log.warning("%s: nats error: %s", self.name, e)

        async def on_disconnect() -> None:
            if self._closing:
                return  # our own close(), not an outage
            log.warning("%s: disconnected from NATS", self.name)

        async def on_reconnect() -> None:
            log.info("%s: reconnected to NATS", self.name)

        deadline = asyncio.get_running_loop().time() + connect_timeout
        while True:
            try:
                self.nc = await nats.connect(
                    url,
                    name=self.name,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    pending_size=64 * 1024 * 1024,
                )
                return
            except Exception as e:  # noqa: BLE001 - any connect failure is retried
                if asyncio.get_running_loop().time() > deadline:
                    raise ConnectionError(
                        f"cannot reach NATS at {url} ({e}); start nats-server or pass --nats-url"
                    ) from e
                await asyncio.sleep(0.25)

    @property
    def client(self) -> Client:
        if self.nc is None:
            raise RuntimeError("Bus.connect() first")
        return self.nc

    def count(self, subject: str, direction: str, num_bytes: int) -> None:
        label = self._labels.get(subject)
        if label is None:
            label = subject_label(subject)
            if label != "_INBOX":  # reply inboxes are one per request: not cached
                self._labels[subject] = label
        entry = self.traffic.get((label, direction))
        if entry is None:
            entry = self.traffic[(label, direction)] = [0, 0]
        entry[0] += 1
        entry[1] += num_bytes

    async def publish(
        self, subject: str, msg: Any, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        data = encode(msg)
        self.count(subject, "out", len(data))
        await self.client.publish(subject, data, reply=reply, headers=headers or None)

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        """Call ``handler(decoded, raw)`` for each message, in arrival order. Failures are
        logged and counted; the subscription goes on."""

        async def cb(raw: Msg) -> None:
            self.count(raw.subject, "in", len(raw.data))
            try:
                msg = decode(raw.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.dropped_messages += 1
                log.warning("%s: dropped undecodable message on %s: %s", self.name, raw.subject, e)
                return
            try:
                await handler(msg, raw)
            except Exception:
                self.dropped_messages += 1
                log.exception(
                    "%s: handler failed on %s (%s)", self.name, raw.subject, type(msg).__name__
                )

        sub = await self.client.subscribe(
            subject,
            queue=queue,
            cb=cb,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
        )
        await self.confirm_subscriptions()
        self.subscriptions.append((subject_label(subject), sub))
        return sub

    async def confirm_subscriptions(self, timeout: float = 5.0) -> None:
        """Return once the server has every SUB this connection has sent so far, so whatever
        the caller announces next (a worker's registration, a request) cannot be answered into
        a subscription the server does not know yet. nats-py buffers SUB, and its ``flush()``
        writes PING ahead of that buffer (nats-py 2.16.0: a flushed subscriber still lost a
        pre-connected publisher's first message in ~5 % of runs), so the round trip here is a
        message to our own inbox: the server handles one connection's commands in order."""
        done = asyncio.get_running_loop().create_future()

        async def on_probe(_raw: Msg) -> None:
            if not done.done():
                done.set_result(None)

        inbox = self.client.new_inbox()
        probe = await self.client.subscribe(inbox, cb=on_probe, max_msgs=1)
        try:
            await self.client.publish(inbox, b"")
            await asyncio.wait_for(done, timeout)
        except (TimeoutError, nats.errors.Error) as e:
            # Reconnecting: nats-py re-sends every SUB on reconnect, so the subscription stands.
            log.warning("%s: subscriptions not confirmed by the server yet: %r", self.name, e)
            with contextlib.suppress(nats.errors.Error):
                await probe.unsubscribe()

    async def request(
        self,
        subject: str,
        msg: Any,
        timeout: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> Message:
        data = encode(msg)
        self.count(subject, "out", len(data))
        reply = await self.client.request(subject, data, timeout=timeout, headers=headers or None)
        self.count("_INBOX.", "in", len(reply.data))
        return decode(reply.data)

    async def reply(self, raw: Msg, msg: Any) -> None:
        if raw.reply:
            data = encode(msg)
            self.count(raw.reply, "out", len(data))
            await self.client.publish(raw.reply, data)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        """Run a background task whose failure is logged, not lost."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s: background task failed", self.name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
