"""NATS subject names. Every instance of a service uses the same names, so instances can be
added without code changes; queue groups spread work across instances."""

PREFIX = "kvflow"

TOKENIZE = f"{PREFIX}.tokenize"  # GenerateRequest, queue group "tokenizer"
TOKENIZER_QUEUE = "tokenizer"
REQUESTS = f"{PREFIX}.requests"  # TokenizedRequest -> scheduler(s), and one detokenizer:
DETOKENIZER_QUEUE = "detokenizer"  # the queue group that shares requests among detokenizers
ABORT = f"{PREFIX}.abort"  # Abort -> scheduler and detokenizer
RESULTS = f"{PREFIX}.results"  # StepResult -> scheduler and detokenizer
# DetokenizerClaims: every detokenizer -> every detokenizer (services/detokenizer/takeover.py)
DETOKENIZER_CLAIMS = f"{PREFIX}.detokenizer.claims"
HEARTBEAT = f"{PREFIX}.workers.heartbeat"  # WorkerHeartbeat -> scheduler
SCHEDULER_STATS = f"{PREFIX}.scheduler.stats"  # request/reply StatsRequest -> SchedulerStats
# request/reply LoraList | LoraLoad | LoraUnload -> LoraAdapters (the leader answers)
SCHEDULER_LORA = f"{PREFIX}.scheduler.lora"
# request/reply LiveRequestsQuery -> LiveRequests (the leader answers; a detokenizer starting)
SCHEDULER_LIVE = f"{PREFIX}.scheduler.live"
# request/reply TokenizeRequest | DetokenizeRequest -> TokenizeResult | DetokenizeResult
TOKENIZER_RPC = f"{PREFIX}.tokenizer.rpc"  # queue group TOKENIZER_QUEUE
KV_DONE = f"{PREFIX}.kv.done"  # KvTransferDone: decode worker -> scheduler
# MetricsRequest (with a reply subject) -> every service instance answers a MetricsReport
METRICS = f"{PREFIX}.metrics"
# a connection back from a lost NATS node asks every service to publish again what it sent
# lately on the subjects of REPLAYED (shared/replay.py); the payload is the asker's id
REPLAY = f"{PREFIX}.bus.replay"


def replayed(subject: str) -> bool:
    """Whether messages on ``subject`` are published again after a NATS node's loss: the ones
    whose receivers drop repeats and put late ones in order (requests, aborts, step results, KV
    hand-off reports, a gateway's deltas). Plans are not (a worker must run a plan once; a lost
    one is recomputed, services/scheduler), nor heartbeats, pings, metrics, request/reply."""
    return subject in _REPLAYED or subject.startswith(_GATEWAYS)


def ping(service: str) -> str:
    """Where every ready instance of ``service`` answers Ping with Pong (no queue group: the
    asker takes the first Pong; shared/ops_http.py)."""
    return f"{PREFIX}.ping.{service}"


def worker_step(worker_id: str) -> str:
    """Where a worker receives its StepPlans."""
    return f"{PREFIX}.worker.{worker_id}.step"


def worker_kv(worker_id: str) -> str:
    """Where a worker serves KvChunkRequest for its blocks (request/reply)."""
    return f"{PREFIX}.worker.{worker_id}.kv"


def gateway_inbox(gateway_id: str) -> str:
    """Where a gateway receives DeltaBatch / RequestError for the requests it submitted."""
    return f"{PREFIX}.gateway.{gateway_id}"


def blob(role: str, conn_id: str) -> str:
    """Where one connection serves the bytes of the large messages it sent (shared/
    large_messages.py): request ``"<id> <chunk>"``, answer the chunk."""
    return f"{PREFIX}.blob.{role or 'any'}.{conn_id}"


def blobs(role: str) -> str:
    """Every blob subject of ``role``'s connections (``*``: of any role)."""
    return f"{PREFIX}.blob.{role}.>"


def subject_label(subject: str) -> str:
    """A subject with its per-instance parts replaced by ``*``, for metric labels (bounded
    cardinality): ``kvflow.gateway.<id>`` -> ``kvflow.gateway.*``, ``kvflow.worker.<id>.step``
    -> ``kvflow.worker.*.step``, ``kvflow.blob.<role>.<id>`` -> ``kvflow.blob.<role>.*``, reply
    inboxes -> ``_INBOX``."""
    if subject.startswith("_INBOX."):
        return "_INBOX"
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == PREFIX and parts[1] in ("gateway", "worker"):
        parts[2] = "*"
    if len(parts) >= 4 and parts[0] == PREFIX and parts[1] == "blob":
        parts[3] = "*"
    return ".".join(parts)


_REPLAYED = frozenset((TOKENIZE, REQUESTS, ABORT, RESULTS, KV_DONE))
_GATEWAYS = f"{PREFIX}.gateway."
