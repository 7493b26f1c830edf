"""Messages larger than the NATS server's ``max_payload`` (1 MiB by default; read from the
server at connect): a long prompt, a long output with logprobs, a large plan. The sender keeps
the encoded bytes for a while and publishes, in their place, an envelope: an empty message whose
``Kvflow-Blob`` header names where to fetch them (the sender's blob subject, an id, the size and
the chunk size). The receiver fetches the chunks by request/reply from that subject, a few in
flight, and hands the joined bytes to the handler as if they had come whole.

Why an envelope rather than chunks on the message's own subject: a queue group (the tokenizers,
the schedulers) gives each message to one member, so chunks published there could land on
different members; the envelope is routed as any message is, and only its receiver fetches. The
fetch is request/reply, one answer per request, which access control allows (``allow_responses``):
every role may publish to ``kvflow.blob.>`` and subscribes only to its own ``kvflow.blob.<role>.>``
(shared/access/grants.py). A receiver waits for the whole message before the next one on that
subscription, so order on a subject is kept. Kept bytes expire after ``BLOB_TTL_S`` (bounded by
``BLOB_MAX_BYTES`` in all: the oldest go first); a fetch after that fails, is logged and counted,
and the message is dropped as an undecodable one would be."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict

from nats.aio.client import Client
from nats.aio.msg import Msg

from kvflow.shared.subjects import blob

BLOB_HEADER = "Kvflow-Blob"
_ERROR_HEADER = "Kvflow-Blob-Error"
BLOB_TTL_S = 60.0
BLOB_MAX_BYTES = 512 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0
FETCH_WINDOW = 4  # chunk requests in flight per message
_HEADROOM = 4096  # room for a message's subject, reply and headers under max_payload


class BlobError(RuntimeError):
    """A large message that could not be fetched (its sender gone, or its bytes expired)."""


def max_message_bytes(client: Client) -> int:
    """The largest encoded message that goes as it is: the server's max_payload less room for
    the subject, reply and headers."""
    limit = getattr(client, "max_payload", 0) or 1024 * 1024
    return max(1024, limit - _HEADROOM)


class LargeMessages:
    """One connection's side of large messages: the bytes it keeps for receivers (served on its
    blob subject) and the fetching of others'."""

    def __init__(self) -> None:
        self.subject = ""
        self._client: Client | None = None
        self._kept: OrderedDict[str, tuple[bytes, int, float]] = (
            OrderedDict()
        )  # id -> (data, chunk, expiry)
        self._kept_bytes = 0
        self.sent = 0  # large messages sent as envelopes
        self.fetched = 0  # large messages received whole
        self.failed = 0  # fetches that failed (logged by the caller)

    async def start(self, client: Client, role: str) -> None:
        """Serve this connection's kept bytes on its blob subject."""
        self._client = client
        self.subject = blob(role, uuid.uuid4().hex)
        await client.subscribe(self.subject, cb=self._serve)

    def envelope(self, data: bytes, client: Client) -> dict[str, str]:
        """Keep ``data`` and return the headers that stand for it (publish them with no data)."""
        self._expire()
        chunk = max_message_bytes(client)
        key = uuid.uuid4().hex
        self._kept[key] = (data, chunk, time.monotonic() + BLOB_TTL_S)
        self._kept_bytes += len(data)
        while self._kept_bytes > BLOB_MAX_BYTES and len(self._kept) > 1:
            _, (old, _, _) = self._kept.popitem(last=False)
            self._kept_bytes -= len(old)
        self.sent += 1
        return {BLOB_HEADER: f"{self.subject} {key} {len(data)} {chunk}"}

    def _expire(self) -> None:
        now = time.monotonic()
        while self._kept:
            key, (data, _, expiry) = next(iter(self._kept.items()))
            if expiry > now:
                break
            del self._kept[key]
            self._kept_bytes -= len(data)

    async def _serve(self, raw: Msg) -> None:
        if not raw.reply or self._client is None:
            return
        try:
            key, index = raw.data.decode().split()
            data, chunk, _ = self._kept[key]
            i = int(index)
        except (ValueError, KeyError, UnicodeDecodeError):
            await self._client.publish(
                raw.reply, b"", headers={_ERROR_HEADER: "unknown or expired"}
            )
            return
        await self._client.publish(raw.reply, data[i * chunk : (i + 1) * chunk])

    async def fetch(self, client: Client, header: str) -> bytes:
        """The bytes an envelope's ``header`` stands for; BlobError if they cannot be had."""
        try:
            subject, key, size_text, chunk_text = header.split()
            size, chunk = int(size_text), int(chunk_text)
        except ValueError as e:
            self.failed += 1
            raise BlobError(f"malformed {BLOB_HEADER} header {header!r}") from e
        count = -(-size // chunk) if size else 0
        parts: list[bytes] = [b""] * count
        window = asyncio.Semaphore(FETCH_WINDOW)

        async def one(i: int) -> None:
            async with window:
                try:
                    reply = await client.request(
                        subject, f"{key} {i}".encode(), timeout=FETCH_TIMEOUT_S
                    )
                except Exception as e:  # noqa: BLE001 - timeout, no responders, closed
                    raise BlobError(f"chunk {i} of {count} from {subject}: {e!r}") from e
                if reply.headers and _ERROR_HEADER in reply.headers:
                    raise BlobError(f"{subject}: {reply.headers[_ERROR_HEADER]}")
                parts[i] = reply.data

        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        except BlobError:
            self.failed += 1
            raise
        data = b"".join(parts)
        if len(data) != size:
            self.failed += 1
            raise BlobError(f"{subject}: got {len(data)} bytes of {size}")
        self.fetched += 1
        return data
