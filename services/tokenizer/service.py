"""The tokenizer service: stateless, in a queue group, so any number of instances share the
load. GenerateRequest in; TokenizedRequest out to the scheduler and detokenizer, or RequestError
straight back to the gateway's inbox. A request with structured output has its constraint
compiled here first (cached per constraint), so a bad schema is a 400, not a failure in a worker.
On a second subject it answers TokenizeRequest / DetokenizeRequest (request/reply).

Each GenerateRequest gets a ``tokenize`` span, the child of the gateway's (its context comes in
the NATS headers and goes on in the TokenizedRequest's headers).

A request or RPC over ``BIG_INPUT_BYTES`` on the wire (a long document, a long conversation, a
long text to ``/tokenize``) is tokenized on a thread of its own, with its own copy of the
tokenizer, one such input at a time: the smaller requests behind it go on being tokenized
meanwhile instead of waiting for it (a 100k-token prompt takes ~0.4 s to encode; the tokenizers
library releases the GIL while it encodes, so the two run on two cores). A subscription hands
messages over in arrival order, one at a time, and both subjects share the event loop, so
without this one long input held up every request after it."""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvflow.services.tokenizer.pooling_inputs import check_task, pooling_input
from kvflow.services.tokenizer.prompts import (
    PromptError,
    bad_words_token_ids,
    check_length,
    check_logit_bias,
    prompt_token_ids,
    truncate,
)
from kvflow.services.tokenizer.rpc import detokenize, tokenize
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth
from kvflow.shared.bus import Bus
from kvflow.shared.chat_template import read_chat_template
from kvflow.shared.config import Settings
from kvflow.shared.logs import request_scope
from kvflow.shared.messages import (
    DetokenizeRequest,
    GenerateRequest,
    Message,
    ModelInfo,
    ModelInfoRequest,
    PoolingParams,
    RequestError,
    SamplingParams,
    StructuredOutput,
    TokenizedRequest,
    TokenizeRequest,
)
from kvflow.shared.models.tasks import ServedTask, served_task
from kvflow.shared.structured_output import GrammarCompiler, GrammarError, tokenizer_info
from kvflow.shared.telemetry import extract, inject, tracer

log = logging.getLogger("kvflow.tokenizer")
_tracer = tracer("tokenizer")

# a request larger than this on the wire (~15 ms of encoding) goes to the big inputs' thread
BIG_INPUT_BYTES = 16 * 1024

T = TypeVar("T")
Prepared = tuple[list[int], SamplingParams, PoolingParams | None]
# how a piece of tokenizer work runs: given a function of the tokenizer, its result
Run = Callable[[Callable[[Any], T]], Awaitable[T]]


class TokenizerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvflow:tokenizer_requests",
            "Generation requests tokenized, by outcome (ok, rejected: a 4xx, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "kvflow:tokenizer_seconds",
            "Time to tokenize and check one request",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry,
        )


class TokenizerService:
    def __init__(
        self,
        settings: Settings,
        tokenizer: Any,
        max_model_len: int,
        eos_ids: list[int],
        vocab_size: int | None = None,
        served: ServedTask | None = None,
    ) -> None:
        self.settings = settings
        self.served = served or ServedTask("generate", "LAST")  # what the model is served for
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size or len(tokenizer)
        self.bus = Bus("tokenizer")
        self.metrics = TokenizerMetrics()
        self._grammar: GrammarCompiler | None = None
        self._subscriptions: list[Any] = []
        # big inputs' work (requests and RPCs), in arrival order, tokenized on their own thread
        self._big: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self._big_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-big-inputs")
        self._big_tokenizer: Any = None  # the thread's copy, made on its first input
        self._no_big_copy = False  # the copy failed: big inputs are tokenized in line
        self._big_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.connect(
            self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "tokenizer")
        )
        self._big_task = asyncio.create_task(self._big_inputs())
        self._subscriptions = [
            await self.bus.subscribe(
                subjects.TOKENIZE, self._on_message, queue=subjects.TOKENIZER_QUEUE
            ),
            await self.bus.subscribe(
                subjects.TOKENIZER_RPC, self._on_rpc, queue=subjects.TOKENIZER_QUEUE
            ),
        ]
        log.info("tokenizer ready")

    async def drain(self) -> None:
        """No new deliveries; the requests in hand, big inputs included, are finished. Then the
        bus can close (it still serves large replies' bytes until then)."""
        for sub in self._subscriptions:
            try:
                await sub.drain()
            except Exception as e:  # noqa: BLE001 - a connection already gone: nothing to wait for
                log.warning("tokenizer: draining a subscription failed: %s", e)
        await self._big.join()
        if self._big_task is not None:
            self._big_task.cancel()
        self._big_thread.shutdown(wait=False)

    def check_structured_output(self, so: StructuredOutput) -> None:
        """Compile the constraint as the worker will (the compiler caches it); PromptError if
        it does not compile. Runs in a thread: a large schema takes a while."""
        if self._grammar is None:
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
            self._grammar = GrammarCompiler(info)
        try:
            self._grammar.compile(so)
        except GrammarError as e:
            raise PromptError(f"invalid {so.param}: {e}", so.param) from e

    async def _by_size(self, raw: Msg, handle: Callable[[Run], Awaitable[None]]) -> None:
        """``handle`` a message now, tokenizing in line, or, over ``BIG_INPUT_BYTES``, queue it
        for the big inputs' thread."""
        if len(raw.data) > BIG_INPUT_BYTES:
            self._big.put_nowait(lambda: handle(self._on_thread))
        else:
            await handle(self._in_line)

    async def _on_rpc(self, msg: Message, raw: Msg) -> None:
        await self._by_size(raw, lambda run: self._answer(msg, raw, run))

    async def _answer(self, msg: Message, raw: Msg, run: Run) -> None:
        """Reply to one RPC (errors too: the caller waits for an answer)."""
        try:
            if isinstance(msg, TokenizeRequest):
                reply: Any = await run(lambda tok: tokenize(tok, msg, self.max_model_len))
            elif isinstance(msg, DetokenizeRequest):
                reply = await run(lambda tok: detokenize(tok, msg))
            elif isinstance(msg, ModelInfoRequest):
                sv = self.served
                reply = ModelInfo(sv.task, self.max_model_len, list(sv.labels))
            else:
                reply = RequestError("", f"unexpected {type(msg).__name__}", "BadRequestError")
        except PromptError as e:
            reply = e.to_message("")
        except Exception as e:  # noqa: BLE001 - the caller gets an error, the service goes on
            log.exception("tokenizer: %s failed", type(msg).__name__)
            reply = RequestError("", f"tokenizer failed: {e}", "InternalServerError", None, 500)
        await self.bus.reply(raw, reply)

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, GenerateRequest):
            log.warning("tokenizer: unexpected %s", type(msg).__name__)
            return
        await self._by_size(raw, lambda run: self._serve(msg, raw, run))

    async def _big_inputs(self) -> None:
        """The big inputs' work, one at a time (its tokenizing on their thread)."""
        while True:
            job = await self._big.get()
            try:
                await job()
            except Exception:  # noqa: BLE001 - every job answers its request; this is a bug
                log.exception("tokenizer: a big input failed")
            finally:
                self._big.task_done()

    async def _serve(self, msg: GenerateRequest, raw: Msg, run: Run) -> None:
        t0 = time.perf_counter()
        with (
            _tracer.start_as_current_span(
                "tokenize",
                context=extract(raw.headers),
                kind=SpanKind.CONSUMER,
                attributes={"kvflow.request_id": msg.request_id},
            ) as span,
            request_scope(msg.request_id),
        ):
            outcome = await self._tokenize(msg, span, run)
        self.metrics.requests.labels(outcome).inc()
        self.metrics.seconds.observe(time.perf_counter() - t0)

    def _prepare(self, tokenizer: Any, msg: GenerateRequest) -> Prepared:
        """The request's token ids and checked parameters (PromptError: what is wrong)."""
        pooling = msg.pooling
        if pooling is not None:  # a pooling input: the whole context, no output token
            ids, pooling = pooling_input(tokenizer, msg, self.served, self.max_model_len)
            params = check_embedding_length(ids, msg.params, self.max_model_len)
        else:
            check_task(self.served, "generate")
            ids = prompt_token_ids(tokenizer, msg)
            ids = truncate(ids, msg.truncate_prompt_tokens, self.max_model_len)
            params = check_length(ids, msg.params, self.max_model_len)
        check_logit_bias(params, len(tokenizer))
        if params.bad_words:
            words = bad_words_token_ids(tokenizer, params.bad_words)
            params = msgspec.structs.replace(params, bad_words_token_ids=words)
        return ids, params, pooling

    async def _in_line(self, work: Callable[[Any], T]) -> T:
        return work(self.tokenizer)

    async def _on_thread(self, work: Callable[[Any], T]) -> T:
        """``work`` on the big inputs' thread, with its copy of the tokenizer."""
        loop = asyncio.get_running_loop()
        if self._big_tokenizer is None and not self._no_big_copy:
            # its own copy: a fast tokenizer used from two threads at once may fail with
            # "Already borrowed" (it changes its truncation settings in place)
            try:
                copied = await loop.run_in_executor(self._big_thread, copy.deepcopy, self.tokenizer)
                self._big_tokenizer = copied
            except Exception as e:  # noqa: BLE001 - a tokenizer that cannot be copied
                log.warning("tokenizer: cannot copy the tokenizer (%s); big inputs in line", e)
                self._no_big_copy = True
        if self._big_tokenizer is None:
            return work(self.tokenizer)
        return await loop.run_in_executor(self._big_thread, work, self._big_tokenizer)

    async def _tokenize(self, msg: GenerateRequest, span: Span, run: Run | None = None) -> str:
        """Tokenize and check ``msg`` (``run``: where; default in line); publish the result or
        the error. Returns the outcome."""
        try:
            ids, params, pooling = await (run or self._in_line)(lambda t: self._prepare(t, msg))
            if params.structured_output is not None:
                await asyncio.to_thread(self.check_structured_output, params.structured_output)
        except PromptError as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            if msg.pooling is not None and e.param is not None:  # the APIs' one input field
                e.param = "input"
            await self.bus.publish(msg.reply_to, e.to_message(msg.request_id))
            return "rejected"
        except Exception as e:  # noqa: BLE001 - the request fails, the service goes on
            log.exception("tokenizer: request %s failed", msg.request_id)
            span.set_status(Status(StatusCode.ERROR, str(e)))
            err = RequestError(
                msg.request_id, f"tokenization failed: {e}", "InternalServerError", None, 500
            )
            await self.bus.publish(msg.reply_to, err)
            return "error"
        span.set_attribute("kvflow.prompt_tokens", len(ids))
        out = TokenizedRequest(
            request_id=msg.request_id,
            reply_to=msg.reply_to,
            prompt_token_ids=ids,
            params=params,
            arrival_time=msg.arrival_time,
            eos_token_ids=self.eos_ids,
            priority=msg.priority,
            cache_salt=msg.cache_salt,
            tool_parsing=msg.tool_parsing,
            pooling=pooling,
            lora=msg.lora,
            return_token_ids=msg.return_token_ids,
            final_only=msg.final_only,
        )
        await self.bus.publish(subjects.REQUESTS, out, inject())
        return "ok"


def check_embedding_length(
    ids: list[int], params: SamplingParams, max_model_len: int
) -> SamplingParams:
    """An embedding input may fill the whole context (no room for an output token needed);
    its ``params`` are unused and pass unchanged."""
    if not ids:
        raise PromptError("the input is empty", "input")
    if len(ids) > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"input has {len(ids)} tokens. Please reduce the length of the input.",
            "input",
        )
    return params


async def run(settings: Settings) -> None:
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import load_tokenizer, resolve_model
    from kvflow.shared.ops_http import start_ops_server

    ops = start_ops_server(settings.ops.ops_port, "tokenizer")
    src = resolve_model(settings.model.path, settings.model.served_model_name)
    cfg = load_config(src)
    tok = load_tokenizer(src, settings.ops.cache_root())
    if settings.model.chat_template:
        tok.chat_template = read_chat_template(settings.model.chat_template)
    max_len = min(settings.model.max_model_len, cfg.max_position_embeddings)
    ms = settings.model
    served = served_task(cfg, src.path if src.kind == "hf" else None, ms.task, ms.pooling_type)
    service = TokenizerService(
        settings, tok, max_len, list(cfg.eos_token_ids), cfg.vocab_size, served
    )
    await service.start()
    ops.registry.register(service.metrics.registry)
    ops.set_ready(lambda: service.bus.client.is_connected, service.bus)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    # SIGTERM: no new deliveries; the requests in hand finish
    log.info("tokenizer draining")
    await service.drain()
    await service.bus.close()
