"""A thin typed layer over nats-py: connect (with reconnect), publish/subscribe kvflow messages,
queue groups, request/reply, headers. Handlers receive decoded messages; a message that does not
decode is logged, counted and dropped, so no service dies on bad input. Every message in and out
is counted with its bytes per subject (``traffic``, shown as metrics by shared/metrics.py).

A service logs in as its role (shared/access/): credentials the server refuses, or a
subscription its role is not granted, end the service with an AccessError naming what was
refused; a publish the server refuses is logged and counted (``permission_denied``).

A message larger than the server's ``max_payload`` travels as an envelope whose bytes the
receiver fetches (shared/large_messages.py); handlers and ``request`` callers see it whole.

``url`` may name several servers of a NATS cluster (comma-separated): the connection picks one
and moves to another when it is lost. Then what the lost node may have dropped is published
again by every service (shared/replay.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvflow.shared.access.connect import AccessError, NatsAuth
from kvflow.shared.large_messages import BLOB_HEADER, BlobError, LargeMessages, max_message_bytes
from kvflow.shared.messages import Message, decode, encode
from kvflow.shared.replay import ReplayLog
from kvflow.shared.subjects import REPLAY, subject_label

log = logging.getLogger("kvflow.bus")
_PERMISSION = "permissions violation"
REPLAY_DELAY_S = 0.2  # asks for a replay that come within this are answered once


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or several (a cluster) separated by commas."""
    return [u.strip() for u in url.split(",") if u.strip()]


def _refusal(e: BaseException) -> str:
    """Why a connect failed, when retrying cannot help (credentials or certificates)."""
    text = str(e)
    if "Authorization Violation" in text or "authorization violation" in text.lower():
        return "authorization violation (wrong or missing user/password)"
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"the server's certificate did not verify ({e.verify_message})"
    if isinstance(e, ssl.SSLError):
        return f"TLS failed ({e.reason})"
    return ""


Handler = Callable[[Message, Msg], Awaitable[None]]


class Bus:
    """One NATS connection of a service."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nc: Client | None = None
        self.dropped_messages = 0  # undecodable or failing messages (logged, then dropped)
        self.permission_denied = 0  # publishes and subscriptions the server refused
        self.auth = NatsAuth()
        self._refused_subscriptions: set[str] = set()
        self._logged_refusals: set[str] = set()
        # (subject label, "in" | "out") -> [messages, bytes]; plain ints, read at scrape time
        self.traffic: dict[tuple[str, str], list[int]] = {}
        self.subscriptions: list[tuple[str, Subscription]] = []  # (subject label, sub)
        self._labels: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.large = LargeMessages()
        self.replay_log = ReplayLog()
        self.conn_id = uuid.uuid4().hex  # tells this connection's replay asks from others'
        self.reconnects = 0
        self._replay_due = False

    async def connect(
        self, url: str, connect_timeout: float = 30.0, auth: NatsAuth | None = None
    ) -> None:
        """Connect as ``auth`` (default: no credentials), retrying until ``connect_timeout``;
        afterwards nats-py reconnects on its own for ever (a NATS outage pauses a service, it
        does not end it). Credentials the server refuses raise AccessError at once."""
        self.auth = auth or NatsAuth()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout
        connecting = True

        async def on_error(e: Exception) -> None:
            if _PERMISSION in str(e):
                self._refused(str(e))
                return
            if connecting:
                # nats-py retries its first connect for ever (max_reconnect_attempts=-1) and
                # calls this after each failure: raising here ends that connect
                refused = _refusal(e)
                if refused:
                    raise AccessError(
                        f"NATS at {url} refused {self.name} ({self.auth.describe()}): {refused}; "
                        "check --nats-user / --nats-password-file and the TLS files "
                        "(`kvflow auth init` makes a role's credentials)"
                    ) from e
                if loop.time() > deadline:
                    raise ConnectionError(
                        f"cannot reach NATS at {url} ({e}); start nats-server or pass --nats-url"
                    ) from e
                return
            log.warning("%s: nats error: %s", self.name, e)

        async def on_disconnect() -> None:
            if self._closing:
                return  # our own close(), not an outage
            log.warning("%s: disconnected from NATS", self.name)

        async def on_reconnect() -> None:
            self.reconnects += 1
            log.info("%s: reconnected to NATS (%s)", self.name, self._server())
            self.spawn(self._after_reconnect())

        nc = Client()
        try:
            await nc.connect(
                server_urls(url),
                name=self.name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                pending_size=64 * 1024 * 1024,
                **self.auth.options(),
            )
        except BaseException:
            # a client that never connected: close() may wait for tasks that never started
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 1.0)
            raise
        finally:
            connecting = False
        self.nc = nc
        await self.large.start(nc, self.auth.role)
        await nc.subscribe(REPLAY, cb=self._on_replay_ask)

    def _server(self) -> str:
        u = self.nc.connected_url if self.nc is not None else None
        return f"{u.hostname}:{u.port}" if u is not None else "?"

    async def _after_reconnect(self) -> None:
        """Back on a (maybe other) NATS server: publish again what the lost one may not have
        forwarded, and ask everyone for what it may have dropped on its way here."""
        await self._replay()
        await self.client.publish(REPLAY, self.conn_id.encode())

    async def _on_replay_ask(self, raw: Msg) -> None:
        if raw.data.decode(errors="replace") == self.conn_id or self._replay_due:
            return
        self._replay_due = True  # several connections come back at once: answer them once
        self.spawn(self._replay(REPLAY_DELAY_S))

    async def _replay(self, delay_s: float = 0.0) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
            self._replay_due = False
        sent = self.replay_log.recent()
        for m in sent:
            await self.client.publish(m.subject, m.data, headers=m.headers)
        if sent:
            log.info(
                "%s: published again the %d messages of the last %.0f s",
                self.name,
                len(sent),
                self.replay_log.window_s,
            )

    def _refused(self, error: str) -> None:
        """A permissions violation the server reported (it dropped the publish, or did not
        make the subscription): counted, logged once per subject."""
        self.permission_denied += 1
        subject = error.rsplit(" ", 1)[-1].strip('"')
        if "subscription" in error:
            self._refused_subscriptions.add(subject)
        if error not in self._logged_refusals:
            self._logged_refusals.add(error)
            log.error("%s (%s): %s", self.name, self.auth.describe(), error)

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

    def _outgoing(
        self, subject: str, msg: Any, headers: dict[str, str] | None
    ) -> tuple[bytes, dict[str, str] | None]:
        """``msg`` encoded and counted; over the server's limit, an envelope in its place."""
        data = encode(msg)
        self.count(subject, "out", len(data))
        if len(data) > max_message_bytes(self.client):
            return b"", (headers or {}) | self.large.envelope(data, self.client)
        return data, headers or None

    async def _whole(self, raw: Msg) -> Msg:
        """``raw``, or the large message its envelope stands for (BlobError if it is lost)."""
        header = raw.headers.get(BLOB_HEADER) if raw.headers else None
        if header is None:
            return raw
        data = await self.large.fetch(self.client, header)
        # without the envelope's header: a handler passing its headers on (trace context) must
        # not make its own message an envelope of this one's bytes
        rest = {k: v for k, v in raw.headers.items() if k != BLOB_HEADER}
        return Msg(self.client, raw.subject, raw.reply, data, rest or None)

    async def publish(
        self, subject: str, msg: Any, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        data, headers = self._outgoing(subject, msg, headers)
        await self.client.publish(subject, data, reply=reply, headers=headers)
        if not reply:
            self.replay_log.record(subject, data, headers)

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        """Call ``handler(decoded, raw)`` for each message, in arrival order. Failures are
        logged and counted; the subscription goes on."""

        async def cb(raw: Msg) -> None:
            try:  # a large message is fetched here, before the next one: order is kept
                raw = await self._whole(raw)
            except BlobError as e:
                self.dropped_messages += 1
                log.warning("%s: dropped a large message on %s: %s", self.name, raw.subject, e)
                return
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
        if subject.lower() in self._refused_subscriptions:
            raise AccessError(
                f"NATS refused {self.name} ({self.auth.describe()}) a subscription to {subject}: "
                "its role is not granted it (shared/access/grants.py)"
            )
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
        data, headers = self._outgoing(subject, msg, headers)
        reply = await self._whole(
            await self.client.request(subject, data, timeout=timeout, headers=headers)
        )
        self.count("_INBOX.", "in", len(reply.data))
        return decode(reply.data)

    async def reply(self, raw: Msg, msg: Any) -> None:
        if raw.reply:
            data, headers = self._outgoing(raw.reply, msg, None)
            await self.client.publish(raw.reply, data, headers=headers)

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
