"""KV block transfer between workers (disaggregated prefill -> decode) and loads from the KV tiers."""

from __future__ import annotations

from kvflow.shared.messages.base import _Msg
from kvflow.shared.messages.steps import BlockRef

# KV block transfer between workers (disaggregated prefill -> decode)
#
#   scheduler --KvPull--> decode worker (its step subject)
#   decode worker --(the KV connector: for NATS, KvChunkRequest to the prefill worker's
#       kv_address, a subject, request/reply, KvChunk back)--> its blocks
#   decode worker --KvTransferDone--> scheduler


class KvPull(_Msg, tag=11):
    """Fetch the K/V of ``src_blocks`` on worker ``src_worker`` into this worker's
    ``dst_blocks`` (pairwise), then report KvTransferDone. ``src_address`` is opaque: the source's
    ``WorkerHeartbeat.kv_address``, whose meaning only the KV connector knows (for NATS, a
    subject); it takes the place of the former ``src_subject`` on the wire."""

    transfer_id: str
    request_id: str
    src_worker: str
    src_address: str  # where the source serves its blocks (the KV connector's address)
    src_blocks: list[int]
    dst_blocks: list[int]
    epoch: int = 0


class KvChunkRequest(_Msg, tag=12):
    """Layers ``[layer_start, layer_end)`` of one block (K then V of each layer)."""

    transfer_id: str
    block: int
    layer_start: int
    layer_end: int


class KvChunk(_Msg, tag=13):
    """The reply to a KvChunkRequest: raw bytes in the source's ``kv_layout``, with their
    CRC-32 so the receiver can tell a damaged chunk from a good one."""

    transfer_id: str
    block: int
    layer_start: int
    layer_end: int
    data: bytes = b""
    crc32: int = 0
    kv_layout: str = ""
    error: str | None = None


class KvTransferDone(_Msg, tag=14):
    transfer_id: str
    request_id: str
    worker_id: str  # the receiving (decode) worker
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class KvLoad(_Msg, tag=17):
    """scheduler -> worker: fill ``blocks`` (in order) from the KV tiers, from the host tier or
    Redis, by their hashes; stop at the first block found in neither; report KvLoadDone."""

    load_id: str
    request_id: str
    blocks: list[BlockRef]
    epoch: int = 0


class KvLoadDone(_Msg, tag=18):
    load_id: str
    request_id: str
    worker_id: str
    num_loaded: int  # leading blocks of the order now holding their content
    host_hits: int = 0
    redis_hits: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
