"""What a scheduler can rebuild from the bus alone: every live request with all the tokens it has
so far, and the ids of recently finished ones.

A standby keeps one from the same messages the detokenizer sees (TokenizedRequest, StepResult,
Abort); the leader's has the requests and finished ids but not their tokens (its core holds them,
and a deposed leader stops: it never leads from its shadow). When a standby takes over, the live
requests resume from their prompt plus the tokens already generated (recompute), so a client's
stream goes on with no token repeated or missing. The recently finished ids make a resubmitted
request (the gateway retries until the scheduler acknowledges) run once, not twice. A step's
tokens are taken in position order (shared/in_order.py): a result published again after a NATS
node's loss is not counted twice, and tokens after a lost one wait for it.

The requests that ended at their worker in the last RECENT_S seconds are kept too, with their
tokens: a detokenizer restarted after the only one died asks for them (LiveRequests), since the
ones that ended while no detokenizer was there have streams still waiting for their text.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvflow.shared.in_order import InOrder
from kvflow.shared.messages import FinishReason, StepResult, TokenizedRequest

RECENT_S = 30.0  # how long a request that ended at its worker is kept with its tokens
RECENT_MAX = 4096  # and at most this many


@dataclass
class LiveRequest:
    request: TokenizedRequest
    output_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0  # how it ended at its worker (FinishReason), for ``recent``


class ShadowState:
    def __init__(self, remember_finished: int = 100_000) -> None:
        self.live: dict[str, LiveRequest] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.remember_finished = remember_finished
        self.order: InOrder[tuple[int, int]] = InOrder()  # (token, finish reason) by position
        # ended at their worker lately: id -> (when, the request with its tokens)
        self.recent: OrderedDict[str, tuple[float, LiveRequest]] = OrderedDict()

    def is_finished(self, request_id: str) -> bool:
        return request_id in self.finished

    def add(self, req: TokenizedRequest) -> bool:
        """Track a new request; False for a duplicate or one that already finished."""
        if req.request_id in self.live or req.request_id in self.finished:
            return False
        self.live[req.request_id] = LiveRequest(req)
        return True

    def end(self, request_id: str, output_ids: list[int] | None = None, reason: int = 0) -> None:
        """``request_id`` ended: with a finish ``reason`` from its worker (and, on the leader,
        its ``output_ids`` from the core) it is kept in ``recent``."""
        self.order.forget(request_id)
        live = self.live.pop(request_id, None)
        if live is not None or request_id not in self.finished:
            self.finished[request_id] = None
            while len(self.finished) > self.remember_finished:
                self.finished.popitem(last=False)
        if live is not None and reason != FinishReason.NONE:
            if output_ids is not None:
                live.output_ids = list(output_ids)
            live.finish_reason = reason
            now = time.monotonic()
            self.recent[request_id] = (now, live)
            while self.recent and (
                len(self.recent) > RECENT_MAX
                or now - next(iter(self.recent.values()))[0] > RECENT_S
            ):
                self.recent.popitem(last=False)

    def ended_lately(self) -> list[LiveRequest]:
        """The requests that ended at their worker in the last RECENT_S seconds."""
        now = time.monotonic()
        return [live for t, live in self.recent.values() if now - t <= RECENT_S]

    def apply(self, result: StepResult) -> None:
        """Record the tokens of a step (in the order the worker published them)."""
        counts = result.num_output_tokens or [0] * len(result.request_ids)
        for rid, tok, reason, count in zip(
            result.request_ids, result.token_ids, result.finish_reasons, counts, strict=True
        ):
            live = self.live.get(rid)
            if live is None:
                continue
            have = len(live.output_ids)
            # a position this request has is dropped (a step re-run after a failure, a replay)
            ready = self.order.push(rid, have, count - 1, count, (tok, reason)) if count else []
            for tok_, reason_ in ready if count else [(tok, reason)]:
                live.output_ids.append(tok_)
                if reason_ != FinishReason.NONE:
                    self.end(rid, reason=reason_)
                    break
        for pooled in result.embeddings:  # an embedding request ends with its vector
            self.end(pooled.request_id)
