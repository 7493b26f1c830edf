"""An asyncio client of the kvflow pipeline over NATS, as a gateway is one: requests go to the
tokenizers' queue group; deltas, errors and acknowledgements come back on this client's own inbox.
Each request is resubmitted with its id until the scheduler acknowledges it
(shared/submission.py), and a delta that repeats tokens already received is dropped."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared import subjects
from shared.bus import Bus
from shared.messages import (
    Abort,
    Accepted,
    Delta,
    DeltaBatch,
    GenerateRequest,
    PromptTokenLogprob,
    RequestError,
    SchedulerStats,
    StatsRequest,
    TokenLogprob,
)
from shared.submission import until_acknowledged

log = logging.getLogger("kvflow.client")


class PipelineError(RuntimeError):
    """The pipeline refused or failed a request (its OpenAI-style error)."""

    def __init__(self, err: RequestError) -> None:
        super().__init__(err.message)
        self.code = err.code
        self.param = err.param
        self.type = err.type


@dataclass
class Completion:
    """Everything the pipeline sent for one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class _Pending:
    req: GenerateRequest
    done: asyncio.Future[Completion]
    accepted: asyncio.Event = field(default_factory=asyncio.Event)
    got: Completion = field(default_factory=Completion)


class PipelineClient:
    def __init__(self, nats_url: str, name: str = "kvflow-python") -> None:
        self.nats_url = nats_url
        self.client_id = f"py-{uuid.uuid4().hex[:12]}"
        self.inbox = subjects.gateway_inbox(self.client_id)
        self.bus = Bus(f"{name}-{self.client_id}")
        self._pending: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        await self.bus.connect(self.nats_url)
        await self.bus.subscribe(self.inbox, self._on_message)

    async def close(self) -> None:
        for p in self._pending.values():
            if not p.done.done():
                p.done.cancel()
        await self.bus.close()

    async def stats(self, timeout: float = 2.0) -> SchedulerStats:
        reply = await self.bus.request(subjects.SCHEDULER_STATS, StatsRequest(), timeout)
        if not isinstance(reply, SchedulerStats):
            raise RuntimeError(f"unexpected reply {type(reply).__name__} to StatsRequest")
        return reply

    async def generate(self, req: GenerateRequest, timeout: float = 3600.0) -> Completion:
        """Run one request to its end; raises PipelineError if the pipeline refuses it."""
        loop = asyncio.get_running_loop()
        req.reply_to = self.inbox
        pending = _Pending(req, loop.create_future())
        self._pending[req.request_id] = pending
        deadline = loop.time() + timeout

        async def acknowledged(wait: float) -> bool:
            if pending.done.done():
                return True
            try:
                await asyncio.wait_for(pending.accepted.wait(), wait)
            except TimeoutError:
                return pending.done.done()
            return True

        async def resubmit() -> None:
            log.warning("request %s not acknowledged yet; resubmitting it", req.request_id)
            await self.bus.publish(subjects.TOKENIZE, req)

        try:
            await self.bus.publish(subjects.TOKENIZE, req)
            watcher = loop.create_task(until_acknowledged(acknowledged, resubmit, deadline))
            try:
                async with asyncio.timeout_at(deadline):
                    return await pending.done
            finally:
                watcher.cancel()
        except BaseException:
            if not pending.done.done() or pending.done.cancelled():
                await self._abort(req.request_id)
            raise
        finally:
            self._pending.pop(req.request_id, None)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.bus.publish(subjects.ABORT, Abort(request_id))
        except Exception as e:  # noqa: BLE001 - the scheduler's timeouts are the backstop
            log.warning("abort of %s not published: %s", request_id, e)

    async def _on_message(self, msg: Any, _raw: Any) -> None:
        match msg:
            case DeltaBatch():
                for delta in msg.deltas:
                    self._on_delta(delta)
            case RequestError():
                p = self._pending.get(msg.request_id)
                if p is not None and not p.done.done():
                    p.done.set_exception(PipelineError(msg))
            case Accepted():
                p = self._pending.get(msg.request_id)
                if p is not None:
                    p.accepted.set()
            case _:
                log.debug("client inbox: ignored %s", type(msg).__name__)

    def _on_delta(self, delta: Delta) -> None:
        p = self._pending.get(delta.request_id)
        if p is None or p.done.done():
            return
        p.accepted.set()
        got = p.got
        if delta.completion_tokens and delta.completion_tokens <= got.completion_tokens:
            return  # a repeat (two detokenizers held the request)
        got.completion_tokens = max(got.completion_tokens, delta.completion_tokens)
        got.text += delta.text
        got.token_ids += delta.token_ids
        got.logprobs += delta.logprobs
        if delta.prompt_logprobs:
            got.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            got.finish_reason = delta.finish_reason
            p.done.set_result(got)
