"""The NATS KV connector (``kv_connector = "nats"``, the default): the worker half serves and
pulls blocks over NATS request/reply; its address is the worker's kv subject
(``subjects.worker_kv``); the scheduler half is the default one (addresses passed through).

Each (block, range of layers) is one chunk,
sized below the server's max payload (never relying on a raised limit). The receiver asks for
chunks with a window of requests in flight, checks each reply's length, layout and CRC-32,
retries a chunk that times out or arrives damaged (tenacity, exponential back-off), and writes
it into its own block. The reply is the acknowledgement of the request; the transfer's end is
acknowledged to the scheduler (KvTransferDone), which only then frees the source's blocks. A
limit on concurrent transfers keeps a burst of hand-offs from flooding the bus. Serving and
receiving run on the event loop while the model thread computes: transfers overlap compute on
both sides.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

import nats.errors
from nats.aio.msg import Msg
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors.base import KvConnectorWorker, TransferResult, order_error
from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.messages import KvChunk, KvChunkRequest, KvPull, Message, encode

log = logging.getLogger("kvflow.worker.kv")


class ChunkError(Exception):
    """A chunk that arrived damaged or that the source could not serve."""


class NatsKvConnector(KvConnectorWorker):
    def __init__(
        self,
        bus: Bus,
        io: KvBlockIO,
        worker_id: str,
        *,
        max_chunk_bytes: int = 512 * 1024,
        window: int = 16,
        chunk_timeout_s: float = 5.0,
        attempts: int = 5,
        max_transfers: int = 4,
    ) -> None:
        super().__init__(bus, io, worker_id)
        self.address = subjects.worker_kv(worker_id)
        self.max_chunk_bytes = max_chunk_bytes
        self.window = window
        self.chunk_timeout_s = chunk_timeout_s
        self.attempts = attempts
        self._transfers = asyncio.Semaphore(max_transfers)
        self.chunks_served = 0
        self.chunks_retried = 0
        self.bytes_received = 0

    # -- serving ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.bus.subscribe(self.address, self._on_request)

    async def close(self) -> None:
        """Nothing to do: the subscription ends with the worker's bus connection."""

    async def _on_request(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, KvChunkRequest):
            log.warning("kv: unexpected %s on %s", type(msg).__name__, raw.subject)
            return
        try:
            want = self.io.layer_bytes * (msg.layer_end - msg.layer_start)
            if want > self.chunk_bytes():
                raise ValueError(
                    f"{want} bytes asked for in one chunk, more than this bus carries "
                    f"({self.chunk_bytes()}); ask for fewer layers"
                )
            data = self.io.read(msg.block, msg.layer_start, msg.layer_end)
            chunk = KvChunk(
                msg.transfer_id,
                msg.block,
                msg.layer_start,
                msg.layer_end,
                data,
                zlib.crc32(data),
                self.io.layout(),
            )
        except ValueError as e:
            chunk = KvChunk(
                msg.transfer_id, msg.block, msg.layer_start, msg.layer_end, error=str(e)
            )
        self.chunks_served += 1
        await self._send_chunk(raw, chunk)

    async def _send_chunk(self, raw: Msg, chunk: KvChunk) -> None:
        """Reply with a chunk (the fault-injection tests override this)."""
        if raw.reply:
            await self.bus.client.publish(raw.reply, encode(chunk))

    # -- pulling ------------------------------------------------------------------------------

    def chunk_bytes(self) -> int:
        """Largest chunk: the configured size, below the server's max payload with room for
        the message's envelope."""
        limit = getattr(self.bus.client, "max_payload", 0) or 1024 * 1024
        return max(1, min(self.max_chunk_bytes, limit - 4096))

    async def pull(self, order: KvPull) -> TransferResult:
        t0 = time.monotonic()
        if error := order_error(order):
            return TransferResult(False, error=error)
        ranges = self.io.layer_chunks(self.chunk_bytes())
        window = asyncio.Semaphore(self.window)
        jobs = [
            (sb, db, l0, l1)
            for sb, db in zip(order.src_blocks, order.dst_blocks, strict=True)
            for l0, l1 in ranges
        ]
        async with self._transfers:
            tasks = [asyncio.ensure_future(self._fetch(order, window, *job)) for job in jobs]
            try:
                sizes = await asyncio.gather(*tasks)
            except Exception as e:  # noqa: BLE001 - a failed transfer is reported, not raised
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                log.warning("kv: transfer %s failed: %s", order.transfer_id, e)
                return TransferResult(False, seconds=time.monotonic() - t0, error=str(e))
        n = sum(sizes)
        self.bytes_received += n
        return TransferResult(True, n, time.monotonic() - t0)

    async def _fetch(
        self, order: KvPull, window: asyncio.Semaphore, sb: int, db: int, l0: int, l1: int
    ) -> int:
        req = KvChunkRequest(order.transfer_id, sb, l0, l1)
        async with window:
            retrying = AsyncRetrying(
                stop=stop_after_attempt(self.attempts),
                wait=wait_exponential(multiplier=0.05, max=1.0),
                retry=retry_if_exception_type(
                    (ChunkError, nats.errors.TimeoutError, nats.errors.NoRespondersError)
                ),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.chunks_retried += 1
                    reply = await self.bus.request(order.src_address, req, self.chunk_timeout_s)
                    data = self._check(reply, req)
        self.io.write(db, data, l0, l1)
        return len(data)

    def _check(self, reply: Message, req: KvChunkRequest) -> bytes:
        if not isinstance(reply, KvChunk):
            raise ChunkError(f"unexpected reply {type(reply).__name__}")
        if reply.error:
            raise ChunkError(f"source error: {reply.error}")
        if (reply.block, reply.layer_start, reply.layer_end) != (
            req.block,
            req.layer_start,
            req.layer_end,
        ):
            raise ChunkError("reply for another chunk")
        if reply.kv_layout != self.io.layout():
            raise ChunkError(f"layout {reply.kv_layout} differs from {self.io.layout()}")
        if len(reply.data) != self.io.layer_bytes * (req.layer_end - req.layer_start):
            raise ChunkError(f"chunk of {len(reply.data)} bytes has the wrong size")
        if zlib.crc32(reply.data) != reply.crc32:
            raise ChunkError("chunk damaged in transit (CRC-32 mismatch)")
        return reply.data
