"""What one gateway instance holds while it runs: its NATS connection, its inbox (a subject of
its own, so any number of gateways can share the pipeline), the per-request queues, and the
aborts in flight. Routes talk to the bus only through this object."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from kvflow.services.gateway.auth import Auth
from kvflow.services.gateway.convert import served_model_name
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.lora import GatewayLoras
from kvflow.services.gateway.metrics import GatewayMetrics
from kvflow.services.gateway.streams import RequestHandle
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    Abort,
    GenerateRequest,
    LoRARef,
    Message,
    ModelInfo,
    ModelInfoRequest,
    Ping,
    Pong,
    RequestError,
    SchedulerStats,
    StatsRequest,
)
from kvflow.shared.metrics import BusCollector, answer_metrics, gather, instance_id, whole_stack
from kvflow.shared.request_streams import RequestStreams
from kvflow.shared.submission import until_acknowledged

log = logging.getLogger("kvflow.gateway")


def bus_connected(bus: Any) -> bool:
    nc = getattr(bus, "nc", None)
    return nc is not None and bool(getattr(nc, "is_connected", False))


class GatewayState:
    def __init__(self, settings: Settings, bus: Bus | None = None) -> None:
        self.settings = settings
        self.gateway_id = uuid.uuid4().hex[:12]
        self.inbox = subjects.gateway_inbox(self.gateway_id)
        self.model_name = served_model_name(settings)
        self.max_model_len = 0  # learnt from the scheduler's stats
        self.streams = RequestStreams()
        self.num_aborts = 0
        self.num_resubmissions = 0  # requests published again for want of an acknowledgement
        self.metrics = GatewayMetrics(self.model_name, settings.model.max_model_len)
        self.metrics.track_open_requests(lambda: len(self.streams))
        self.auth = Auth(settings)
        self.loras = GatewayLoras(settings, self.model_name)  # LoRA adapters (lora.py)
        self._own_bus = bus is None
        self.bus: Any = bus if bus is not None else Bus(f"gateway-{self.gateway_id}")
        self.instance = instance_id(f"gateway-{self.gateway_id}")
        self.metrics.registry.register(BusCollector("gateway", self.bus))
        self._sub: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._model_info: ModelInfo | None = None  # the tokenizer's first answer (model_info)

    async def start(self) -> None:
        """Connect (unless given a connected bus) and listen on the inbox before serving."""
        if getattr(self.bus, "nc", None) is None:
            await self.bus.connect(
                self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "gateway")
            )
        await self.auth.start()
        self._sub = await self.bus.subscribe(self.inbox, self.streams.handler)
        await answer_metrics(self.bus, "gateway", self.instance, self.metrics.render)
        log.info("gateway %s serving %s, inbox %s", self.gateway_id, self.model_name, self.inbox)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass
        if self._tasks:  # let pending aborts go out before the connection closes
            await asyncio.wait(set(self._tasks), timeout=2.0)
        await self.auth.close()
        if self._own_bus:
            await self.bus.close()

    async def submit(
        self, req: GenerateRequest, headers: dict[str, str] | None = None
    ) -> RequestHandle:
        """Register the request's queue, then publish it to the tokenizers (``headers``: the
        request's trace context); 503 if NATS is not
        there, rather than a request that waits for its timeout; 429 when this gateway already
        holds ``--max-open-requests``. Until the scheduler acknowledges the request (Accepted,
        or any reply), it is published again with the same id (the scheduler runs an id once):
        a submission lost to a NATS outage or a scheduler failover is not lost."""
        if not bus_connected(self.bus):
            raise APIError(503, "the gateway is not connected to NATS", "ServiceUnavailableError")
        if len(self.streams) >= self.settings.gateway.max_open_requests:
            raise APIError(
                429,
                f"this gateway has {len(self.streams)} requests open "
                f"(--max-open-requests {self.settings.gateway.max_open_requests}); retry later",
                "RateLimitError",
            )
        queue = self.streams.open(req.request_id)  # before publishing: replies can be fast
        try:
            await self.bus.publish(subjects.TOKENIZE, req, headers)
        except Exception as e:  # noqa: BLE001 - any publish failure means: not served
            self.streams.close(req.request_id)
            log.warning("publish of %s failed: %s", req.request_id, e)
            raise APIError(
                503, f"cannot submit the request to the pipeline: {e}", "ServiceUnavailableError"
            ) from e
        loop = asyncio.get_running_loop()
        timeout = self.settings.gateway.request_timeout
        deadline = loop.time() + timeout
        task = loop.create_task(self._until_accepted(req, deadline, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return RequestHandle(req.request_id, queue, deadline, timeout, self._closed)

    async def _until_accepted(
        self, req: GenerateRequest, deadline: float, headers: dict[str, str] | None = None
    ) -> None:
        """Publish ``req`` again while no acknowledgement came and the request is open."""
        await until_acknowledged(
            lambda wait: self.streams.wait_accepted(req.request_id, wait),
            lambda: self._resubmit(req, headers),
            deadline,
        )

    async def _resubmit(self, req: GenerateRequest, headers: dict[str, str] | None = None) -> None:
        self.num_resubmissions += 1
        log.warning("request %s not acknowledged yet; resubmitting it", req.request_id)
        try:
            await self.bus.publish(subjects.TOKENIZE, req, headers)
        except Exception as e:  # noqa: BLE001 - NATS away: the next attempt may get through
            log.warning("resubmission of %s failed: %s", req.request_id, e)

    def _closed(self, request_id: str, finished: bool) -> None:
        self.streams.close(request_id)
        if not finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Publish ``Abort`` from a background task: callers are often cancelled tasks, where
        an await could be cancelled before the message leaves."""
        self.num_aborts += 1
        self.metrics.aborts.labels(self.model_name).inc()
        task = asyncio.get_running_loop().create_task(self._publish_abort(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_abort(self, request_id: str) -> None:
        try:
            await self.bus.publish(subjects.ABORT, Abort(request_id))
        except Exception as e:  # noqa: BLE001 - the scheduler's own timeouts are the backstop
            log.warning("abort of %s not published: %s", request_id, e)

    async def tokenizer_call(self, msg: Message, expect: type, timeout: float = 10.0) -> Any:
        """Request/reply with a tokenizer (TokenizeRequest, DetokenizeRequest): the reply of
        type ``expect``, a RequestError as APIError, or 503 when no tokenizer answers."""
        if not bus_connected(self.bus):
            raise APIError(503, "the gateway is not connected to NATS", "ServiceUnavailableError")
        try:
            reply = await self.bus.request(subjects.TOKENIZER_RPC, msg, timeout)
        except Exception as e:  # noqa: BLE001 - no responder, timeout, closed connection
            raise APIError(
                503, f"no tokenizer answered ({type(e).__name__})", "ServiceUnavailableError"
            ) from e
        if isinstance(reply, RequestError):
            raise APIError(reply.code, reply.message, reply.type, reply.param)
        if not isinstance(reply, expect):
            raise APIError(
                503, f"unexpected reply {type(reply).__name__}", "ServiceUnavailableError"
            )
        return reply

    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        """What the served model is for (its task, length, a classifier's labels), asked of a
        tokenizer once: the gateway may run without the model files. The first answer is kept
        (a stack serves one model); no answer is the 503 of ``tokenizer_call``."""
        if self._model_info is None:
            self._model_info = await self.tokenizer_call(ModelInfoRequest(), ModelInfo, timeout)
        return self._model_info

    async def served_task(self) -> str | None:
        """The served task where it can be known cheaply, for routes that only check it: the
        tokenizer's answer (cached), else an explicit ``--task``, else a short question to a
        tokenizer; None when none answers. The tokenizer checks every request's task itself
        (a 400 too), so a gateway that cannot tell yet lets the request go on."""
        if self._model_info is not None:
            return self._model_info.task
        if self.settings.model.task != "auto":
            return self.settings.model.task
        try:
            return (await self.model_info(timeout=2.0)).task
        except APIError:
            return None

    async def metrics_text(self, whole_stack_view: bool = True) -> bytes:
        """This gateway's series, and with ``whole_stack_view`` every other service's,
        gathered over NATS (shared/metrics.py); its own alone when NATS is away."""
        own = self.metrics.render()
        if not whole_stack_view or not bus_connected(self.bus):
            return own
        try:
            reports = await gather(self.bus)
        except Exception as e:  # noqa: BLE001 - the gateway's own series are still worth serving
            log.warning("metrics of the other services not gathered: %s", e)
            return own
        return whole_stack(own, "gateway", self.instance, reports)

    async def ping(self, service: str, timeout: float = 1.0) -> None:
        """Returns once a ready instance of ``service`` answers; 503 naming it otherwise."""
        if not bus_connected(self.bus):
            raise APIError(503, "the gateway is not connected to NATS", "ServiceUnavailableError")
        try:
            reply = await self.bus.request(subjects.ping(service), Ping(), timeout)
        except Exception as e:  # noqa: BLE001 - no responder, timeout, closed connection
            raise APIError(
                503, f"no {service} is ready ({type(e).__name__})", "ServiceUnavailableError"
            ) from e
        if not isinstance(reply, Pong):
            raise APIError(
                503, f"unexpected reply {type(reply).__name__} to Ping", "ServiceUnavailableError"
            )

    async def resolve_model(self, requested: str | None) -> tuple[str, LoRARef | None]:
        """The served model a request's ``model`` names (404 otherwise), and its adapter."""
        return await self.loras.resolve(self.bus, requested)

    async def scheduler_stats(self, timeout: float = 1.0) -> SchedulerStats:
        """The scheduler's counters, or 503 saying what is missing."""
        if not bus_connected(self.bus):
            raise APIError(503, "the gateway is not connected to NATS", "ServiceUnavailableError")
        try:
            reply = await self.bus.request(subjects.SCHEDULER_STATS, StatsRequest(), timeout)
        except Exception as e:  # noqa: BLE001 - no responder, timeout, closed connection
            raise APIError(
                503,
                f"no scheduler answered on {subjects.SCHEDULER_STATS} ({e})",
                "ServiceUnavailableError",
            ) from e
        if not isinstance(reply, SchedulerStats):
            raise APIError(
                503,
                f"unexpected reply {type(reply).__name__} to StatsRequest",
                "ServiceUnavailableError",
            )
        if reply.max_model_len:
            self.max_model_len = reply.max_model_len
        return reply
