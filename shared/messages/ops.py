"""Operations: metrics scatter-gather, readiness pings and the detokenizers' claims."""

from __future__ import annotations

from kvflow.shared.messages.base import _Msg

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
