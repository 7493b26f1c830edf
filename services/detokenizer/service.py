"""The detokenizer service: receives every worker's StepResult (one message per step), turns each
sequence's new token into text with its DetokState, and sends one DeltaBatch per gateway inbox.
When a stop string ends a sequence it tells the scheduler (Abort with reason STOP).

Any number of detokenizers share the work: each new request goes to one of them (a NATS queue
group on the requests subject), which then handles that request's tokens; step results go to
all, and each keeps only its own. Each also keeps, untouched, the requests and tokens the others
hold, and takes over a dead one's requests within seconds (takeover.py). On SIGTERM a
detokenizer leaves the queue group (no new requests) and finishes the ones it has, then exits.
Should a request ever reach two (a resubmission, or a replay after a lost NATS node, landing
elsewhere), both send the same deltas and the gateway keeps one: a detokenizer takes a request
only when it has every token of it, i.e. when the tokens it kept for it while it was unknown
here start at the first; one that reaches it after its first tokens went by is another's, and
is left to it.

Embedding requests (``TokenizedRequest.pooling``) have no text: the one StepResult entry of
their vector (``StepResult.embeddings``) passes through as the request's only, final Delta.

Each request has a ``detokenize`` span from its registration to its last token (the child of
the tokenizer's span, whose context the TokenizedRequest's NATS headers carry)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import OrderedDict, defaultdict
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind

from kvflow.services.detokenizer.state import DetokState
from kvflow.services.detokenizer.takeover import CLAIM_INTERVAL_S, Token, Watch, Watched
from kvflow.services.detokenizer.telemetry import DetokenizerMetrics
from kvflow.services.detokenizer.tool_parsers import ToolParserErrors
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings, check_stream_interval
from kvflow.shared.in_order import InOrder, lost_in_transit
from kvflow.shared.logs import request_scope
from kvflow.shared.messages import (
    Abort,
    Delta,
    DeltaBatch,
    DetokenizerClaims,
    FinishReason,
    LiveRequests,
    LiveRequestsQuery,
    Message,
    PooledOutput,
    PromptLogprobs,
    SampleLogprobs,
    StepResult,
    StepVoid,
    TokenizedRequest,
)
from kvflow.shared.metrics import instance_id
from kvflow.shared.telemetry import extract, tracer
from kvflow.shared.voided_steps import VoidedSteps

log = logging.getLogger("kvflow.detokenizer")
_tracer = tracer("detokenizer")

GAP_TIMEOUT_S = 10.0  # a result lost in transit is published again within a few seconds
EARLY_RESULT_TTL_S = 10.0  # results that arrive before their request's registration wait this long


class DetokenizerService:
    def __init__(self, settings: Settings, tokenizer: Any) -> None:
        check_stream_interval(settings)
        self.settings = settings
        self.stream_interval = settings.gateway.stream_interval
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.bus = Bus("detokenizer")
        self.states: dict[str, DetokState] = {}
        self.spans: dict[str, Span] = {}  # request id -> its detokenize span, while here
        self.watch = Watch(instance_id(self.bus.name))  # the requests other detokenizers hold
        self.metrics = DetokenizerMetrics(lambda: len(self.states), lambda: self.watch.taken_over)
        self.metrics.registry.register(ToolParserErrors())
        self.done: OrderedDict[str, None] = OrderedDict()  # recently ended, to ignore late results
        # each request's tokens in position order (shared/in_order.py): repeats of a re-run
        # step or of a replay dropped, tokens after a lost result held until it comes again
        self.order: InOrder[tuple[str, int, int, SampleLogprobs | None]] = InOrder()
        self.voided = VoidedSteps()  # steps the scheduler gave up (shared/voided_steps.py)
        # tokens of requests not known here yet: (position, or 0 where the sender numbers none;
        # token, finish reason, logprobs), from when the first came
        self.early: dict[str, tuple[float, list[Token]]] = {}
        self.early_prompt: dict[str, tuple[float, list[PromptLogprobs]]] = {}
        self.embeds: dict[str, tuple[str, int]] = {}  # embedding: id -> (reply_to, prompt len)
        self.early_embeds: dict[str, tuple[float, PooledOutput]] = {}
        self._requests_sub: Any = None
        self._watch_sub: Any = None
        self.draining = False
        self.stopped = asyncio.Event()
        self._emptied = asyncio.Event()  # set when the last request here ends

    async def start(self) -> None:
        await self.bus.connect(
            self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "detokenizer")
        )
        self._requests_sub = await self.bus.subscribe(
            subjects.REQUESTS, self._on_message, queue=subjects.DETOKENIZER_QUEUE
        )
        self._watch_sub = await self.bus.subscribe(subjects.REQUESTS, self._on_watched)
        await self.bus.subscribe(subjects.RESULTS, self._on_message)
        await self.bus.subscribe(subjects.ABORT, self._on_message)
        await self.bus.subscribe(subjects.DETOKENIZER_CLAIMS, self._on_message)
        self.bus.spawn(self._watch_live())
        self.bus.spawn(self._claim_loop())
        log.info("detokenizer ready")

    async def _watch_live(self, attempts: int = 5) -> None:
        """Watch the requests running as this detokenizer starts (the scheduler's leader says
        which, with their tokens): a dead detokenizer's among them are taken over here. Alone
        (no other detokenizer's claims heard), also the requests that ended lately: ended while
        no detokenizer was there, their streams still wait. None answers while the stack starts
        (nothing runs yet) or has no leader: carried on without."""
        await asyncio.sleep(CLAIM_INTERVAL_S * 2.5)  # the other detokenizers' claims come
        alone = not set(self.watch.members) - {self.watch.instance}
        for _ in range(attempts):
            query = LiveRequestsQuery(ended_lately=alone)
            try:
                live = await self.bus.request(subjects.SCHEDULER_LIVE, query, 2.0)
            except Exception as e:  # noqa: BLE001 - no scheduler (yet): nothing to watch
                log.debug("detokenizer: no answer about live requests: %r", e)
                await asyncio.sleep(1.0)
                continue
            if isinstance(live, LiveRequests):
                self.watch_live(live)
                return

    def watch_live(self, live: LiveRequests) -> None:
        """Watch each request of ``live`` not held here, with its tokens so far."""
        reasons = live.finish_reasons or [0] * len(live.requests)
        for req, outputs, reason in zip(live.requests, live.output_ids, reasons, strict=True):
            rid = req.request_id
            if rid in self.states or rid in self.done or rid in self.embeds:
                continue
            tokens = [(i + 1, t, int(FinishReason.NONE), None) for i, t in enumerate(outputs)]
            if tokens and reason:
                tokens[-1] = (*tokens[-1][:2], reason, None)
            lossy = req.params.logprobs is not None or req.params.prompt_logprobs is not None
            self.watch.add(req, None, tokens, lossy)
        if live.requests:
            log.info("detokenizer: watching %d live requests", len(live.requests))

    async def _on_watched(self, msg: Message, raw: Msg) -> None:
        """Every request, held here or by another detokenizer: one held elsewhere is watched
        (its tokens kept, takeover.py), with the tokens of it that came before it."""
        rid = getattr(msg, "request_id", None)
        if not isinstance(msg, TokenizedRequest) or rid in self.states or rid in self.done:
            return
        if rid in self.embeds or self.draining:
            return
        self.watch.add(msg, raw.headers, self.early.pop(rid, (0.0, []))[1])
        w = self.watch.requests.get(rid)
        if w is not None:
            w.prompt_logprobs += self.early_prompt.pop(rid, (0.0, []))[1]
            w.embedding = w.embedding or self.early_embeds.pop(rid, (0.0, None))[1]

    async def _claim_loop(self) -> None:
        """Twice a second: say what this detokenizer holds, and take over the requests of the
        detokenizers that stopped saying it."""
        while not self.stopped.is_set():
            held = [*self.states, *self.embeds]
            claims = DetokenizerClaims(self.watch.instance, held, self.draining)
            try:
                await self.bus.publish(subjects.DETOKENIZER_CLAIMS, claims)
            except Exception as e:  # noqa: BLE001 - disconnected: the claims go out next time
                log.debug("detokenizer: claims not sent: %r", e)
            for w in self.watch.orphans(self.draining):
                with request_scope(w.request.request_id):
                    await self._take_over(w)
            await asyncio.sleep(CLAIM_INTERVAL_S)

    async def _take_over(self, w: Watched) -> None:
        """A dead detokenizer's request: registered here with every token so far, every delta
        sent again (the gateway keeps the ones it lacks). One whose first tokens this one never
        saw ends with an error: its text could not be told from the start."""
        rid = w.request.request_id
        positions = sorted(t[0] for t in w.tokens if t[0] > 0)
        if (positions and positions[0] != 1) or w.lossy:
            what = "the logprobs it asked for" if w.lossy else "its first tokens"
            log.error("detokenizer: %s lost its detokenizer and %s; ending it", rid, what)
            self._mark_done(rid)
            await self.bus.publish(w.request.reply_to, lost_in_transit(rid))
            await self.bus.publish(subjects.ABORT, Abort(rid, FinishReason.ABORT))
            return
        log.warning(
            "detokenizer: taking over %s (%d tokens so far) from a detokenizer that is gone",
            rid,
            len(w.tokens),
        )
        await self._register(w.request, w.headers, kept=w)

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        match msg:
            case TokenizedRequest():
                with request_scope(msg.request_id):
                    await self._register(msg, raw.headers)
            case StepResult():
                if self.voided.drops(msg):  # its sequences were recomputed: not streamed
                    log.warning(
                        "detokenizer: a result of voided step %d of %s dropped",
                        msg.step_id,
                        msg.worker_id,
                    )
                    return
                t0 = time.perf_counter()
                await self._on_result(msg)
                self.metrics.steps.observe(time.perf_counter() - t0)
            case StepVoid():
                self.voided.add(msg)
            case DetokenizerClaims():
                self.watch.on_claims(msg)
            case Abort():
                self.watch.pop(msg.request_id)
                if self.embeds.pop(msg.request_id, None) is not None:
                    self._mark_done(msg.request_id)
                self.order.forget(msg.request_id)
                if self.states.pop(msg.request_id, None) is not None:
                    self._end_span(msg.request_id, "abort")
                    self._mark_done(msg.request_id)
            case _:
                log.warning("detokenizer: unexpected %s on %s", type(msg).__name__, raw.subject)

    async def _register(
        self,
        req: TokenizedRequest,
        headers: dict[str, str] | None = None,
        kept: Watched | None = None,
    ) -> None:
        """Hold ``req`` here, with what came of it before (``kept``: what the watch kept of a
        request held elsewhere until now)."""
        if req.request_id in self.states or req.request_id in self.done:
            return  # a resubmission (the gateway retries until acknowledged): already known
        kept = kept or self.watch.pop(req.request_id)
        tokens = [*(kept.tokens if kept else ()), *self.early.pop(req.request_id, (0.0, []))[1]]
        prompt_pieces = [
            *(kept.prompt_logprobs if kept else ()),
            *self.early_prompt.pop(req.request_id, (0.0, []))[1],
        ]
        numbered = sorted({e[0]: e for e in tokens if e[0] > 0}.values())
        if numbered and numbered[0][0] != 1:
            # its first tokens went by before it was known here: another detokenizer has it (a
            # replay landed here); taking it would send text from a wrong position
            log.info(
                "detokenizer: %s reached here at token %d: another detokenizer has it",
                req.request_id,
                numbered[0][0],
            )
            return
        if req.pooling is not None:  # an embedding: its vector passes through (_send_vectors)
            self.embeds[req.request_id] = (req.reply_to, len(req.prompt_token_ids))
            vector = self.early_embeds.pop(req.request_id, (0.0, kept and kept.embedding))[1]
            if vector is not None:
                await self._send_vectors([vector])
            return
        self.spans[req.request_id] = _tracer.start_span(
            "detokenize",
            context=extract(headers),
            kind=SpanKind.CONSUMER,
            attributes={"kvflow.request_id": req.request_id},
        )
        st = DetokState(
            req.request_id,
            req.reply_to,
            req.params,
            len(req.prompt_token_ids),
            tool_parsing=req.tool_parsing,
            return_token_ids=req.return_token_ids,
            final_only=req.final_only,
        )
        if req.params.prompt_logprobs is not None and req.prompt_token_ids:
            st.first_prompt_token = req.prompt_token_ids[0]
        self.states[req.request_id] = st
        for piece in prompt_pieces:
            st.add_prompt_logprobs(self.backend, piece)
        if numbered:  # in position order, each position once
            entries = [(req.request_id, t, r, lp) for _, t, r, lp in numbered]
            await self._apply(self._in_order(entries, [e[0] for e in numbered]))
        # from senders that number no positions, as they came
        await self._apply([(req.request_id, t, r, lp) for c, t, r, lp in tokens if c == 0])

    async def _on_result(self, res: StepResult) -> None:
        if res.embeddings:
            await self._send_vectors(res.embeddings)
        for piece in res.prompt_logprobs:  # before the tokens: a first delta carries them
            st = self.states.get(piece.request_id)
            if st is not None:
                st.add_prompt_logprobs(self.backend, piece)
            elif self.watch.add_prompt_logprobs(piece):
                pass
            elif piece.request_id not in self.done:
                self.early_prompt.setdefault(piece.request_id, (time.monotonic(), []))[1].append(
                    piece
                )
        lps = res.logprobs or [None] * len(res.request_ids)
        entries = list(zip(res.request_ids, res.token_ids, res.finish_reasons, lps, strict=True))
        if res.num_output_tokens:
            entries = self._in_order(entries, res.num_output_tokens)
        await self._apply(entries)
        self._expire_early()
        await self._expire_gaps()

    def _in_order(
        self, entries: list[tuple[str, int, int, SampleLogprobs | None]], counts: list[int]
    ) -> list[tuple[str, int, int, SampleLogprobs | None]]:
        """The entries of requests held here in position order (``counts``: each token's
        position, counting it): a position the request has had is dropped (a step re-run after a
        failure, a result published again), one past a gap waits for the gap to fill."""
        out = []
        have: dict[str, int] = {}
        for e, count in zip(entries, counts, strict=True):
            st = self.states.get(e[0])
            if st is None and count > 0:  # not known here yet: kept with its position
                self._keep_early(count, *e)
                continue
            if st is None or count <= 0:
                out.append(e)  # not numbered (kept as early by _apply if not known here)
                continue
            seen = have.get(e[0], st.completion_tokens)
            ready = self.order.push(e[0], seen, count - 1, count, e)
            out += ready
            have[e[0]] = seen + len(ready)
        return out

    async def _expire_gaps(self) -> None:
        """A request whose tokens stopped at a gap for GAP_TIMEOUT_S: the result that filled it is
        lost for good; the request ends with an error (never a text with a hole)."""
        for rid in self.order.gaps(GAP_TIMEOUT_S):
            self.order.forget(rid)
            st = self.states.pop(rid, None)
            if st is None:
                continue
            log.error("detokenizer: %s lost a step's tokens in transit; ending it", rid)
            self._end_span(rid, "error", st.completion_tokens)
            self._mark_done(rid)
            await self.bus.publish(st.reply_to, lost_in_transit(rid))
            await self.bus.publish(subjects.ABORT, Abort(rid, FinishReason.ABORT))

    @property
    def duplicates_dropped(self) -> int:
        """Tokens dropped as positions already had."""
        return self.order.repeats

    async def _apply(self, entries: list[tuple[str, int, int, SampleLogprobs | None]]) -> None:
        out: dict[str, list[Delta]] = defaultdict(list)
        stopped: list[str] = []
        mine = 0  # tokens of requests held here (every detokenizer sees every result)
        for rid, tok, reason, lp in entries:
            st = self.states.get(rid)
            if st is None:
                self._keep_early(0, rid, tok, reason, lp)
                continue
            delta, by_stop = st.add_token(self.backend, tok, FinishReason.of(reason), lp)
            mine += 1
            if st.completion_tokens == 1 and rid in self.spans:
                self.spans[rid].add_event("first_token")
            ready = st.release(delta, self.stream_interval)
            if ready is not None:
                out[st.reply_to].append(ready)
            if st.finished:
                del self.states[rid]
                self.order.forget(rid)
                self._end_span(rid, delta.finish_reason, st.completion_tokens)
                self._mark_done(rid)
                if by_stop:
                    stopped.append(rid)
        self.metrics.tokens.inc(mine)
        for reply_to, deltas in out.items():
            await self.bus.publish(reply_to, DeltaBatch(deltas))
        for rid in stopped:
            await self.bus.publish(subjects.ABORT, Abort(rid, FinishReason.STOP))

    def _keep_early(
        self, position: int, rid: str, tok: int, reason: int, lp: SampleLogprobs | None
    ) -> None:
        """A token of a request not held here (yet): watched, kept early unless it ended here
        already."""
        if self.watch.add_token(rid, (position, tok, reason, lp)):
            return
        if rid not in self.done:
            self.early.setdefault(rid, (time.monotonic(), []))[1].append(
                (position, tok, reason, lp)
            )

    async def _send_vectors(self, outs: list[PooledOutput]) -> None:
        """Each vector of an embedding request held here goes to its gateway as the final
        Delta; vectors of requests not registered yet wait (as early tokens do)."""
        out: dict[str, list[Delta]] = defaultdict(list)
        for pooled in outs:
            dest = self.embeds.pop(pooled.request_id, None)
            if dest is None:
                if self.watch.add_embedding(pooled):
                    continue
                if pooled.request_id not in self.done:
                    self.early_embeds[pooled.request_id] = (time.monotonic(), pooled)
                continue
            reply_to, prompt_tokens = dest
            out[reply_to].append(
                Delta(
                    pooled.request_id,
                    "",
                    finish_reason="stop",
                    prompt_tokens=prompt_tokens,
                    embedding=pooled.data,
                )
            )
            self._mark_done(pooled.request_id)
        for reply_to, deltas in out.items():
            await self.bus.publish(reply_to, DeltaBatch(deltas))

    def _end_span(self, rid: str, reason: str | None, tokens: int = 0) -> None:
        span = self.spans.pop(rid, None)
        if span is not None:
            span.set_attribute("kvflow.finish_reason", reason or "")
            span.set_attribute("kvflow.completion_tokens", tokens)
            span.end()

    async def begin_drain(self) -> None:
        """SIGTERM: take no new requests, finish the ones here, then stop (or after
        --drain-timeout)."""
        if self.draining:
            return
        self.draining = True
        log.info("detokenizer draining: %d requests to finish", len(self.states))
        self.watch.requests.clear()  # a draining detokenizer takes over nothing
        for sub in (self._requests_sub, self._watch_sub):
            if sub is not None:
                await sub.unsubscribe()
        if self.states or self.embeds:
            self._emptied.clear()
            try:
                await asyncio.wait_for(self._emptied.wait(), self.settings.ops.drain_timeout)
            except TimeoutError:
                pass
        if self.states:
            log.warning(
                "detokenizer: %d requests unfinished at the drain timeout", len(self.states)
            )
        self.stopped.set()

    def _mark_done(self, rid: str) -> None:
        if not self.states and not self.embeds:
            self._emptied.set()
        self.done[rid] = None
        while len(self.done) > 100_000:
            self.done.popitem(last=False)

    def _expire_early(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (t, _) in self.early.items() if now - t > EARLY_RESULT_TTL_S]:
            del self.early[rid]
        for rid in [r for r, (t, _) in self.early_prompt.items() if now - t > EARLY_RESULT_TTL_S]:
            del self.early_prompt[rid]
        for rid in [r for r, (t, _) in self.early_embeds.items() if now - t > EARLY_RESULT_TTL_S]:
            del self.early_embeds[rid]


async def run(settings: Settings) -> None:
    from kvflow.shared.model_source import load_tokenizer, resolve_model
    from kvflow.shared.ops_http import start_ops_server

    ops = start_ops_server(settings.ops.ops_port, "detokenizer")
    src = resolve_model(settings.model.path, settings.model.served_model_name)
    tok = load_tokenizer(src, settings.ops.cache_root())
    service = DetokenizerService(settings, tok)
    await service.start()
    ops.registry.register(service.metrics.registry)
    ops.set_ready(lambda: service.bus.client.is_connected and not service.draining, service.bus)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: service.bus.spawn(service.begin_drain())
    )
    await service.stopped.wait()
    await service.bus.close()
