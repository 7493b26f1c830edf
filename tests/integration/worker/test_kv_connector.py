"""KV block transfer between two workers' caches through each registered transport, built by the
connector factory with the same assertions (NATS over a real nats-server whose max payload is far
below one block; the in-process one), then what only NATS does: chunking, integrity checks,
retries, and the limits in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors.base import KvConnectorWorker
from kvflow.services.worker.kv_connectors.factory import create_worker_connector
from kvflow.services.worker.kv_connectors.nats import NatsKvConnector
from kvflow.shared.bus import Bus
from kvflow.shared.infra import start_nats
from kvflow.shared.messages import KvChunk, KvPull

pytestmark = pytest.mark.integration

LAYERS, BS, HKV, D = 6, 16, 2, 64  # one block: 6 * 2 * 16*2*64*4 B = 96 KiB
MAX_PAYLOAD = 32 * 1024


@pytest.fixture(scope="module")
def small_nats():
    server = start_nats(max_payload=MAX_PAYLOAD)
    try:
        yield server.url
    finally:
        server.stop()


def caches(seed: int | None, num_blocks: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (num_blocks, BS, HKV, D)
    if g is None:
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)
    ]


class LossyConnector(NatsKvConnector):
    """Drops the first reply of some chunks and damages the first reply of others."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: set[tuple[int, int]] = set()
        self.dropped = 0
        self.damaged = 0

    async def _send_chunk(self, raw, chunk: KvChunk) -> None:
        key = (chunk.block, chunk.layer_start)
        first = key not in self.seen
        self.seen.add(key)
        if first and chunk.block % 3 == 0:
            self.dropped += 1
            return
        if first and chunk.block % 3 == 1 and chunk.data:
            self.damaged += 1
            data = bytearray(chunk.data)
            data[len(data) // 2] ^= 0xFF
            chunk.data = bytes(data)
        await super()._send_chunk(raw, chunk)


async def pair(url: str, src_cls=NatsKvConnector, **kw):
    a, b = Bus("src"), Bus("dst")
    await a.connect(url)
    await b.connect(url)
    src_kv, dst_kv = caches(1), caches(None)
    src = src_cls(a, KvBlockIO(src_kv), "src", **kw)
    dst = NatsKvConnector(b, KvBlockIO(dst_kv), "dst", **kw)
    await src.start()
    return a, b, src, dst, src_kv, dst_kv


TRANSPORTS = ["nats", "inproc"]
FAST_FAIL = {"nats": {"chunk_timeout_s": 0.2, "attempts": 2}, "inproc": {}}  # give up soon


async def workers(url: str, transport: str, src_kv, dst_kv, **kw):
    """Two workers' halves of ``transport`` built by the factory, the source serving."""
    a, b = Bus("src"), Bus("dst")
    await a.connect(url)
    await b.connect(url)
    src = create_worker_connector(transport, a, KvBlockIO(src_kv), f"src-{transport}", **kw)
    dst = create_worker_connector(transport, b, KvBlockIO(dst_kv), f"dst-{transport}", **kw)
    await src.start()
    return a, b, src, dst


async def close(a: Bus, b: Bus, *halves: KvConnectorWorker) -> None:
    for h in halves:
        await h.close()
    await a.close()
    await b.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_blocks_move_between_two_workers(small_nats, transport) -> None:
    src_kv, dst_kv = caches(1), caches(None)
    a, b, src, dst = await workers(small_nats, transport, src_kv, dst_kv)
    try:
        assert src.address and src.address != dst.address
        order = KvPull("t1", "r1", src.worker_id, src.address, [3, 7, 0, 11], [0, 1, 2, 5])
        result = await dst.pull(order)
        assert result.ok, result.error
        assert result.num_bytes == 4 * dst.io.block_bytes
        assert same_blocks(src_kv, dst_kv, zip(order.src_blocks, order.dst_blocks, strict=True))
        untouched = [3, 4, 6]  # blocks not named in the order stay zero
        assert all(int(torch.count_nonzero(dst_kv[0][0][i])) == 0 for i in untouched)
        bad = KvPull("t1b", "r1", src.worker_id, src.address, [1, 2], [3])
        assert not (await dst.pull(bad)).ok  # unequal lists: refused, nothing raised
    finally:
        await close(a, b, src, dst)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_vanished_source_fails_the_pull_without_raising(small_nats, transport) -> None:
    a, b, gone, dst = await workers(
        small_nats, transport, caches(1), caches(None), **FAST_FAIL[transport]
    )
    await gone.close()
    await a.close()  # the source leaves: nobody serves its address any more
    try:
        order = KvPull("t3", "r3", gone.worker_id, gone.address, [1], [2])
        result = await asyncio.wait_for(dst.pull(order), 10)
        assert not result.ok and result.error
    finally:
        await b.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_layout_mismatch_is_refused(nats_url, transport) -> None:
    """(The default max payload: with a small one, NATS refuses the differently sized chunks
    the receiver asks for before any layout is compared.)"""
    other = [(torch.zeros(12, BS, HKV, 32), torch.zeros(12, BS, HKV, 32)) for _ in range(LAYERS)]
    a, b, src, dst = await workers(nats_url, transport, caches(1), other, **FAST_FAIL[transport])
    try:
        result = await dst.pull(KvPull("t4", "r4", src.worker_id, src.address, [1], [1]))
        assert not result.ok and "layout" in (result.error or ""), result.error
    finally:
        await close(a, b, src, dst)


def same_blocks(src_kv, dst_kv, pairs) -> bool:
    return all(
        torch.equal(src_kv[layer][kv][s], dst_kv[layer][kv][d])
        for layer in range(LAYERS)
        for kv in (0, 1)
        for s, d in pairs
    )


async def test_nats_blocks_arrive_in_chunks_below_the_max_payload(small_nats) -> None:
    a, b, src, dst, src_kv, dst_kv = await pair(small_nats)
    try:
        assert dst.chunk_bytes() < MAX_PAYLOAD < dst.io.block_bytes
        order = KvPull("t1", "r1", "src", src.address, [3, 7, 0, 11], [0, 1, 2, 5])
        result = await dst.pull(order)
        assert result.ok, result.error
        assert result.num_bytes == 4 * dst.io.block_bytes
        assert same_blocks(src_kv, dst_kv, zip(order.src_blocks, order.dst_blocks, strict=True))
        untouched = [3, 4, 6]  # blocks not named in the order stay zero
        assert all(int(torch.count_nonzero(dst_kv[0][0][i])) == 0 for i in untouched)
        assert src.chunks_served == 4 * len(dst.io.layer_chunks(dst.chunk_bytes())) > 4
    finally:
        await a.close()
        await b.close()


async def test_nats_lost_and_damaged_chunks_are_retried(small_nats) -> None:
    a, b, src, dst, src_kv, dst_kv = await pair(
        small_nats, LossyConnector, chunk_timeout_s=0.3, window=4
    )
    try:
        order = KvPull("t2", "r2", "src", src.address, [0, 1, 2, 4], [8, 9, 10, 11])
        result = await dst.pull(order)
        assert result.ok, result.error
        assert src.dropped > 0 and src.damaged > 0
        assert dst.chunks_retried == src.dropped + src.damaged
        assert same_blocks(src_kv, dst_kv, zip(order.src_blocks, order.dst_blocks, strict=True))
    finally:
        await a.close()
        await b.close()
