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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvflow.shared.in_order import InOrder
from kvflow.shared.messages import FinishReason, StepResult, TokenizedRequest


@dataclass
class LiveRequest:
    request: TokenizedRequest
    output_ids: list[int] = field(default_factory=list)


class ShadowState:
    def __init__(self, remember_finished: int = 100_000) -> None:
        self.live: dict[str, LiveRequest] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.remember_finished = remember_finished
        self.order: InOrder[tuple[int, int]] = InOrder()  # (token, finish reason) by position

    def is_finished(self, request_id: str) -> bool:
        return request_id in self.finished

    def add(self, req: TokenizedRequest) -> bool:
        """Track a new request; False for a duplicate or one that already finished."""
        if req.request_id in self.live or req.request_id in self.finished:
            return False
        self.live[req.request_id] = LiveRequest(req)
        return True

    def end(self, request_id: str) -> None:
        self.order.forget(request_id)
        if self.live.pop(request_id, None) is not None or request_id not in self.finished:
            self.finished[request_id] = None
            while len(self.finished) > self.remember_finished:
                self.finished.popitem(last=False)

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
                    self.end(rid)
                    break
        for pooled in result.embeddings:  # an embedding request ends with its vector
            self.end(pooled.request_id)
