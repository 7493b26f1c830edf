"""Operations: metrics scatter-gather, readiness pings and the detokenizers' claims."""

from __future__ import annotations

from kvflow.shared.messages.base import _Msg
from kvflow.shared.messages.requests import TokenizedRequest

# metrics, scatter-gather (the gateway's /metrics serves the whole stack). Tags from 30 on.


class MetricsRequest(_Msg, tag=30):
    """Sent on ``kvflow.metrics`` with a reply subject: every service instance answers with a
    MetricsReport."""


class MetricsReport(_Msg, tag=31):
    """One service instance's Prometheus text exposition (what its /metrics serves)."""

    service: str  # gateway | tokenizer | scheduler | worker | detokenizer
    instance: str  # unique per process
    text: bytes


class Ping(_Msg, tag=32):
    """Sent on ``kvflow.ping.<service>`` (request/reply, the service's queue group): one ready
    instance of that service answers with a Pong. The gateway's /health asks the services that
    have no other request/reply (tokenizer, detokenizer) whether one of them is there."""


class Pong(_Msg, tag=33):
    service: str
    instance: str


class DetokenizerClaims(_Msg, tag=34):
    """Sent on ``kvflow.detokenizer.claims`` by every detokenizer twice a second: the requests
    it holds (services/detokenizer/takeover.py). A request that nobody has claimed for a while
    is taken over by a surviving detokenizer; ``draining``: this one takes over nothing."""

    instance: str
    request_ids: list[str]
    draining: bool = False


class LiveRequestsQuery(_Msg, tag=35):
    """Sent on ``kvflow.scheduler.live`` (request/reply, the leader answers) by a detokenizer as
    it starts: the requests running now, which it watches (a dead detokenizer's among them);
    ``ended_lately``: also those that ended at their worker in the last seconds (asked by one
    that hears no other detokenizer: their streams may still wait for their text)."""

    ended_lately: bool = False


class LiveRequests(_Msg, tag=36):
    """Every live request and the tokens it has generated so far, in position order; the
    finish reason of its last token (0 while it runs)."""

    requests: list[TokenizedRequest] = []
    output_ids: list[list[int]] = []
    finish_reasons: list[int] = []
