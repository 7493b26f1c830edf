"""Taking over the requests of a detokenizer that died.

Each request is held by one detokenizer (the NATS queue group on the requests subject hands it
to one), but every detokenizer sees every request (a second, plain subscription) and every step
result. What a detokenizer sees of the requests it does not hold it keeps here, as they came: the
request and its tokens in position order, nothing turned into text (appending a token is all the
work it costs). Twice a second every detokenizer says which requests it holds
(``DetokenizerClaims``); a request kept here that no detokenizer has claimed for ``ORPHAN_S`` is
an orphan: its detokenizer died (or never registered it). One surviving detokenizer, the same
for each request on every survivor (rendezvous hashing over the live, non-draining members),
takes it over: it registers the request with every token so far and sends every delta again.
A detokenizer that starts asks the scheduler for the requests running then, with their tokens
(``LiveRequests``), and watches them too: the requests of the only detokenizer, restarted after
it died, are taken over by its new process (those that asked for logprobs end with an error: the
scheduler does not keep them).
Delta boundaries are a function of the tokens alone (DetokState), so the gateway, which drops
deltas whose tokens it has (shared/request_streams.py), keeps exactly the ones it lacks and the
stream goes on with the same text. Two survivors that disagree about who takes a request over
both send the same deltas: one copy is kept."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from kvflow.shared.messages import (
    DetokenizerClaims,
    PooledOutput,
    PromptLogprobs,
    SampleLogprobs,
    TokenizedRequest,
)

CLAIM_INTERVAL_S = 0.5  # how often a detokenizer says what it holds
ORPHAN_S = 2.5  # unclaimed this long (5 claims missed): its detokenizer is gone

# (position, or 0 where the sender numbers none; token, finish reason, logprobs)
Token = tuple[int, int, int, SampleLogprobs | None]


@dataclass
class Watched:
    """A request held by another detokenizer, as this one saw it."""

    request: TokenizedRequest
    headers: dict[str, str] | None
    claimed: float  # when it came here, then when its holder last claimed it
    holder: str | None = None  # the detokenizer that claims it (None: nobody has yet)
    tokens: list[Token] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embedding: PooledOutput | None = None
    lossy: bool = False  # its tokens came without the logprobs it asked for (LiveRequests)


def _rank(request_id: str, instance: str) -> bytes:
    return hashlib.blake2b(f"{request_id}|{instance}".encode(), digest_size=8).digest()


class Watch:
    """The requests other detokenizers hold, and which detokenizers are alive; owned by one
    DetokenizerService. Times are ``time.monotonic()`` unless given.

    A watched request ends here when its holder, alive, stops claiming it (it finished there),
    on an Abort, or when it is taken over. It is an orphan when nobody has claimed it for
    ORPHAN_S and its holder (if any) is gone: the live, non-draining detokenizer that ranks
    highest for it takes it over, and after twice that any survivor does (the one chosen may
    not have seen the request: it started after it)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.requests: dict[str, Watched] = {}
        self.members: dict[str, tuple[float, bool]] = {}  # instance -> (last claims, draining)
        self.taken_over = 0

    def add(
        self,
        req: TokenizedRequest,
        headers: dict[str, str] | None,
        early: list[Token],
        lossy: bool = False,
    ) -> Watched:
        """A request seen on the plain subscription (or in LiveRequests), with its tokens that
        came before it; a second sight adds its tokens (positions are read once when it is
        taken over)."""
        w = self.requests.get(req.request_id)
        if w is None:
            w = self.requests[req.request_id] = Watched(req, headers, time.monotonic())
        w.tokens += early
        w.lossy = w.lossy or lossy
        return w

    def pop(self, request_id: str) -> Watched | None:
        """Stop watching ``request_id`` (it is held here now, or it was aborted)."""
        return self.requests.pop(request_id, None)

    def add_token(self, request_id: str, token: Token) -> bool:
        """Keep a token of a watched request; whether it is watched."""
        w = self.requests.get(request_id)
        if w is not None:
            w.tokens.append(token)
        return w is not None

    def add_prompt_logprobs(self, piece: PromptLogprobs) -> bool:
        w = self.requests.get(piece.request_id)
        if w is not None:
            w.prompt_logprobs.append(piece)
        return w is not None

    def add_embedding(self, pooled: PooledOutput) -> bool:
        w = self.requests.get(pooled.request_id)
        if w is not None:
            w.embedding = pooled
        return w is not None

    def on_claims(self, claims: DetokenizerClaims, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.members[claims.instance] = (now, claims.draining)
        held = set(claims.request_ids)
        for rid, w in list(self.requests.items()):
            if rid in held:
                w.holder, w.claimed = claims.instance, now
            elif w.holder == claims.instance:  # it ended there
                del self.requests[rid]

    def orphans(self, draining: bool, now: float | None = None) -> list[Watched]:
        """The orphans this detokenizer takes over (none while it drains); they are no longer
        watched."""
        now = time.monotonic() if now is None else now
        for inst in [i for i, (t, _) in self.members.items() if now - t > ORPHAN_S]:
            del self.members[inst]  # gone
        if draining:
            return []
        takers = {i for i, (_, d) in self.members.items() if not d} | {self.instance}
        out = []
        for rid, w in list(self.requests.items()):
            unclaimed = now - w.claimed
            if w.holder in self.members or unclaimed <= ORPHAN_S:
                continue
            chosen = max(takers, key=lambda i, rid=rid: _rank(rid, i)) == self.instance
            if chosen or unclaimed > 2 * ORPHAN_S:
                out.append(self.requests.pop(rid))
        self.taken_over += len(out)
        return out
