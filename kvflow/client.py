"""An asyncio client of the kvflow pipeline over NATS, as a gateway is one: requests go to the
tokenizers' queue group; deltas, errors and acknowledgements come back on this client's own inbox.
Each request is resubmitted with its id until the scheduler acknowledges it
(shared/submission.py), and a delta that repeats tokens already received is dropped."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from kvflow.shared import subjects
from kvflow.shared.access.connect import NatsAuth
from kvflow.shared.bus import Bus
from kvflow.shared.messages import (
    Abort,
    Delta,
    GenerateRequest,
    LoraAdapters,
    LoraList,
    LoraLoad,
    PromptTokenLogprob,
    RequestError,
    SchedulerStats,
    StatsRequest,
    TokenLogprob,
)
from kvflow.shared.request_streams import RequestStreams
from kvflow.shared.submission import until_acknowledged

log = logging.getLogger("kvflow.client")


class PipelineError(RuntimeError):
    """The pipeline refused or failed a request (its OpenAI-style error)."""

    def __init__(self, err: RequestError) -> None:
        super().__init__(err.message)
        self.code = err.code
        self.param = err.param
        self.type = err.type


def user_error(e: BaseException) -> BaseException:
    """What the Python API raises for ``e``: a pipeline refusal (400) becomes a ValueError naming
    the parameter, as vLLM raises; anything else stays as it is."""
    if isinstance(e, PipelineError) and e.code == 400:
        err = ValueError(f"{e.param}: {e}" if e.param else str(e))
        err.param = e.param  # type: ignore[attr-defined]
        return err
    return e


@dataclass
class Completion:
    """Everything the pipeline sent for one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # when the request's return_token_ids
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    embedding: bytes = b""  # an embedding request's vector (little-endian float32)
    prompt_tokens: int = 0


class PipelineClient:
    def __init__(
        self, nats_url: str, name: str = "kvflow-python", auth: NatsAuth | None = None
    ) -> None:
        """``auth``: the gateway role's login (the client does what a gateway does)."""
        self.nats_url = nats_url
        self.auth = auth
        self.client_id = f"py-{uuid.uuid4().hex[:12]}"
        self.inbox = subjects.gateway_inbox(self.client_id)
        self.bus = Bus(f"{name}-{self.client_id}")
        self.streams = RequestStreams()

    async def start(self) -> None:
        await self.bus.connect(self.nats_url, auth=self.auth)
        await self.bus.subscribe(self.inbox, self.streams.handler)

    async def close(self) -> None:
        for rid in self.streams.ids():  # wake every waiting generate()
            self.streams.dispatch(
                RequestError(rid, "the client closed", "APIConnectionError", None, 503)
            )
        await self.bus.close()

    async def stats(self, timeout: float = 2.0) -> SchedulerStats:
        reply = await self.bus.request(subjects.SCHEDULER_STATS, StatsRequest(), timeout)
        if not isinstance(reply, SchedulerStats):
            raise RuntimeError(f"unexpected reply {type(reply).__name__} to StatsRequest")
        return reply

    async def lora(self, msg: LoraLoad | LoraList, timeout: float = 75.0) -> LoraAdapters:
        """Ask the scheduler to load (or list) LoRA adapters; raises ValueError for a refusal."""
        reply = await self.bus.request(subjects.SCHEDULER_LORA, msg, timeout)
        if not isinstance(reply, LoraAdapters):
            raise RuntimeError(f"unexpected reply {type(reply).__name__} to {type(msg).__name__}")
        if reply.error:
            raise ValueError(reply.error)
        return reply

    async def generate(self, req: GenerateRequest, timeout: float = 3600.0) -> Completion:
        """Run one request to its end; raises PipelineError if the pipeline refuses it."""
        loop = asyncio.get_running_loop()
        rid = req.request_id
        req.reply_to = self.inbox
        queue = self.streams.open(rid)  # before publishing: replies can be fast
        deadline = loop.time() + timeout
        got = Completion()
        ended = False  # the final delta or an error came: nothing to abort

        async def resubmit() -> None:
            log.warning("request %s not acknowledged yet; resubmitting it", rid)
            await self.bus.publish(subjects.TOKENIZE, req)

        try:
            await self.bus.publish(subjects.TOKENIZE, req)
            watcher = loop.create_task(
                until_acknowledged(
                    lambda wait: self.streams.wait_accepted(rid, wait), resubmit, deadline
                )
            )
            try:
                async with asyncio.timeout_at(deadline):
                    while not ended:
                        item = await queue.get()
                        if isinstance(item, RequestError):
                            ended = True
                            raise PipelineError(item)
                        _add(got, item)
                        ended = got.finish_reason is not None
                return got
            finally:
                watcher.cancel()
        except BaseException:
            if not ended:
                await self._abort(rid)
            raise
        finally:
            self.streams.close(rid)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.bus.publish(subjects.ABORT, Abort(request_id))
        except Exception as e:  # noqa: BLE001 - the scheduler's timeouts are the backstop
            log.warning("abort of %s not published: %s", request_id, e)


def _add(got: Completion, delta: Delta) -> None:
    got.text += delta.text
    got.token_ids += delta.token_ids
    got.logprobs += delta.logprobs
    if delta.prompt_logprobs:
        got.prompt_logprobs = delta.prompt_logprobs
    got.finish_reason = delta.finish_reason
    got.prompt_tokens = max(got.prompt_tokens, delta.prompt_tokens)
    if delta.embedding:
        got.embedding = delta.embedding
