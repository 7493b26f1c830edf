"""Batched token sampling where the logits are (the GPU on the device path, the CPU otherwise):
one row of logits per sequence that samples this step, after the features' logits processors
(shared/sampling/processors.py) have changed the rows.

Nothing here reads a value back from a GPU: the batch's settings are tensors made on the logits'
device from what each request's parameters decided once (``DrawRow``, host values), every branch
is decided from those, and only the sampled ids (and the logprobs asked for) leave the device,
once per step (on the CPU one check looks at values: ``_best``). Every transform works row by
row (sorts, cumsums and softmaxes along the vocab of one row). A seeded request's uniform for
its n-th output token is a function of (seed, n) alone (``counter_uniform``, computed on the
host with the batch's settings): the same tokens whatever else is in the batch, after a
preemption, on another worker (migration, a disaggregated hand-off) and with speculative
decoding (a rejected draft's row consumes nothing), and no per-row generator call on the device.
The draw is by inverse CDF, one uniform per row (exact sampling from the filtered distribution;
an exponential race would draw a vocabulary of noise per row, which on the CPU cost more than
the step's sort). Top-k and top-p work on each row's best tokens only (``topk``, not a sort of
the vocabulary, when the rows' top-k bound them). Greedy rows skip temperature,
top-k/top-p/min-p and the draw (they cannot change a greedy row's argmax), as vLLM's sampler
does.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.shared.messages import SampleLogprobs, SamplingParams
from kvflow.shared.sampling import GREEDY_EPS, RowState, apply_processors

NUCLEUS_GUESS = 2048  # CPU: candidates taken by top-k before falling back to a whole-row sort


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors on the logits' device, built once per step by
    ``make_batch`` (one copy to the device; none when every row is greedy: the settings are
    then None); the row lists and widths are decided from the parameters (host values)."""

    temperature: torch.Tensor | None  # [S] float; 1.0 for greedy rows
    top_p: torch.Tensor | None  # [S] float, 1.0 = off
    top_k: torch.Tensor | None  # [S] long, 0 = off
    min_p: torch.Tensor | None  # [S] float, 0.0 = off
    seeded: torch.Tensor | None  # [R] long: the sampled rows with a seed (None: no such row)
    seeded_u: torch.Tensor | None  # [R] float64: their uniforms (``counter_uniform``)
    plain: list[int]  # sampled rows drawn from the whole vocabulary
    filtered: list[int]  # sampled rows with top-k or top-p
    width: int  # candidates the filtered rows need (their largest top-k); 0: no bound
    all_greedy: bool
    needs_min_p: bool


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs pass as random. Also
    of a numpy uint64 array, element by element (its products wrap as ``& _MASK`` does)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def seed_stream(seed: int) -> int:
    """The state splitmix64 starts from for a request seeded with ``seed`` (the mixed seed)."""
    return _mix64((seed + _GOLDEN) & _MASK)


def counter_uniform(seed: int, position: int) -> float:
    """The U[0, 1) a request seeded with ``seed`` draws for its ``position``-th output token
    (0-based): the ``position``-th output of splitmix64 started from the mixed seed, 53 bits."""
    z = _mix64((seed_stream(seed) + (position + 1) * _GOLDEN) & _MASK)
    return (z >> 11) * (1.0 / (1 << 53))


def counter_uniforms(streams: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """``counter_uniform`` of many rows at once (float64 [R]), the same bits: ``streams`` are the
    rows' ``seed_stream``s (256 rows: ~45 us, against ~0.6 ms one by one in Python)."""
    pos = np.array(positions, dtype=np.uint64)
    z = _mix64(np.array(streams, dtype=np.uint64) + (pos + 1) * np.uint64(_GOLDEN))
    return (z >> 11).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True, slots=True)
class DrawRow:
    """What one request's parameters decide for the draw, made once when the worker learns the
    request (``draw_row``; runner.RequestState.draw): a step's ``make_batch`` only gathers its
    rows' (at 256 rows, building these from the parameters every step cost ~0.3 ms of host
    work a step)."""

    greedy: bool
    settings: bytes  # temperature (1.0 when greedy), top-p, top-k, min-p: 4 float32
    seeded: bool  # a seed given: its uniforms are counter_uniform's
    stream: int  # seed_stream(seed) (0 without a seed)
    filtered: bool  # top-k or top-p on
    top_k: int  # 0: off
    min_p: bool  # min-p on


def draw_row(p: SamplingParams) -> DrawRow:
    """``p``'s DrawRow. Top-k goes as a float32, exact for any vocabulary (under 2^24)."""
    greedy = float(p.temperature) < GREEDY_EPS
    temperature = 1.0 if greedy else float(p.temperature)
    top_k = max(int(p.top_k), 0)
    values = array.array("f", (temperature, float(p.top_p), top_k, float(p.min_p)))
    return DrawRow(
        greedy=greedy,
        settings=values.tobytes(),
        seeded=p.seed is not None,
        stream=0 if p.seed is None else seed_stream(int(p.seed)),
        filtered=top_k > 0 or p.top_p < 1.0,
        top_k=top_k,
        min_p=p.min_p > 0,
    )


def make_batch(
    draws: Sequence[DrawRow],
    positions: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """The rows' settings on ``device`` (where the logits are), from each row's ``DrawRow``.
    ``positions``: each row's output token index (what a seeded row's uniform is drawn for);
    needed when a sampled row has a seed."""
    rows = [i for i, d in enumerate(draws) if not d.greedy]
    if not rows:  # argmax only: no settings built or copied
        return SamplingBatch(
            temperature=None,
            top_p=None,
            top_k=None,
            min_p=None,
            seeded=None,
            seeded_u=None,
            plain=[],
            filtered=[],
            width=0,
            all_greedy=True,
            needs_min_p=False,
        )
    seeded = [i for i in rows if draws[i].seeded]
    if seeded and positions is None:
        raise ValueError("a seeded row needs its output position")
    filtered = [i for i in rows if draws[i].filtered]
    bounded = all(draws[i].top_k > 0 for i in filtered)
    # one [S, 4] float32 copy: the rows' settings side by side
    values = bytearray(b"".join([d.settings for d in draws]))
    settings = torch.frombuffer(values, dtype=torch.float32).view(-1, 4).to(device)

    return SamplingBatch(
        temperature=settings[:, 0],
        top_p=settings[:, 1],
        top_k=settings[:, 2].long(),
        min_p=settings[:, 3],
        seeded=_on(np.array(seeded, dtype=np.int64), device) if seeded else None,
        seeded_u=_uniforms_of(draws, seeded, positions, device) if seeded else None,
        plain=[i for i in rows if not draws[i].filtered],
        filtered=filtered,
        width=max((draws[i].top_k for i in filtered), default=0) if bounded else 0,
        all_greedy=False,
        needs_min_p=any(draws[i].min_p for i in rows),
    )


def _uniforms_of(
    draws: Sequence[DrawRow], rows: list[int], positions: Sequence[int], device: torch.device | str
) -> torch.Tensor:
    """The seeded ``rows``' uniforms (``counter_uniform``) on ``device``."""
    u = counter_uniforms([draws[i].stream for i in rows], [positions[i] for i in rows])
    return _on(u, device)


def _on(values: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``values`` on ``device`` (through numpy: ``torch.tensor`` of a list of 256 ints alone
    took ~70 us)."""
    return torch.from_numpy(values).to(device, non_blocking=True)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    thresh = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < thresh, float("-inf"))


def _best(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's best tokens in order (logits and ids, [S, K]): enough of them to hold the
    row's top-k and nucleus, and the probability they hold of the row's whole vocabulary when
    that is not all of it and the row has no top-k (None: all of it). ``width``: the largest
    top-k when every row has one. Otherwise a whole-row sort, except on the CPU, where a sort
    of the vocabulary costs more than the rest of sampling: the best ``NUCLEUS_GUESS`` tokens
    are enough when they hold more than top_p of each row's probability (a row with top-k
    needs only its k)."""
    vocab = x.shape[-1]
    if width:
        vals, ids = x.topk(min(width, vocab), dim=-1)
        return vals, ids, None
    if x.device.type == "cpu" and NUCLEUS_GUESS < vocab:
        vals, ids = x.topk(NUCLEUS_GUESS, dim=-1)
        held = (torch.logsumexp(vals, -1) - torch.logsumexp(x, -1)).exp()
        enough = (top_k > 0) & (top_k <= NUCLEUS_GUESS) | (held >= top_p + 1e-4)
        if bool(enough.all()):  # a read back: on the CPU it costs nothing
            return vals, ids, torch.where(top_k > 0, 1.0, held)
    vals, ids = x.sort(dim=-1, descending=True)
    return vals, ids, None


def _candidates(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' top-k, then the minimal nucleus whose probability (over the top-k, or the whole
    vocabulary without top-k) reaches top_p, the top token always kept: candidate logits best
    first (the rest -inf) and their token ids."""
    vals, ids, held = _best(x, top_k, top_p, width)
    k = vals.shape[-1]
    rank = torch.arange(k, device=x.device)[None, :]
    k_rows = torch.where(top_k > 0, top_k.clamp(max=k), k)
    vals = vals.masked_fill(rank >= k_rows[:, None], -torch.inf)
    probs = torch.softmax(vals, dim=-1)  # over the top-k, or the whole row
    if held is not None:  # the best NUCLEUS_GUESS of a row without top-k: of the whole row
        probs = probs * held[:, None]
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = (before >= top_p[:, None]) & (rank > 0) & (top_p < 1.0)[:, None]
    return vals.masked_fill(drop, -torch.inf), ids


def _uniforms(batch: SamplingBatch, rows: int, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: a seeded row's from ``counter_uniform`` (made with the batch), the
    others' from the device's default RNG."""
    u = torch.rand(rows, device=device, dtype=torch.float64)
    if batch.seeded is not None:
        u.index_copy_(0, batch.seeded, batch.seeded_u)
    return u


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the cumulative probability of ``softmax(logits)`` passes
    ``u`` of its total (in float64: tail tokens keep their weight over a long vocabulary); a
    token of probability 0 is never picked."""
    cdf = torch.softmax(logits, dim=-1).double().cumsum(dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row of ``logits`` [S, V]; returns [S] long on the logits' device.
    Greedy rows take the argmax; the others temperature, min-p, top-k/top-p, then an
    inverse-CDF draw of one uniform per row (exact sampling from the filtered distribution)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return tokens
    dev = logits.device
    x = logits / batch.temperature[:, None]
    if batch.needs_min_p:
        x = _apply_min_p(x, batch.min_p)
    u = _uniforms(batch, len(x), dev)

    def pick(rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | slice]:
        if len(rows) == len(x):
            return None, slice(None)
        idx = _on(np.array(rows, dtype=np.int64), dev)
        return idx, idx

    for rows, filtered in ((batch.plain, False), (batch.filtered, True)):
        if not rows:
            continue
        idx, at = pick(rows)
        xs, us = (x, u) if idx is None else (x[idx], u[idx])
        if filtered:
            k, p = (
                (batch.top_k, batch.top_p) if idx is None else (batch.top_k[idx], batch.top_p[idx])
            )
            vals, ids = _candidates(xs, k, p, batch.width)
            got = ids.gather(1, _inverse_cdf(vals, us)[:, None])[:, 0]
        else:
            got = _inverse_cdf(xs, us)
        tokens[at] = got
    return tokens


def logprobs_of(raw: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int]) -> list[SampleLogprobs]:
    """Log-probabilities of the model's raw distribution (before penalties, bias or
    temperature, as vLLM reports them) of each row's sampled token ``tokens`` [A], plus the top
    ``ks[row]`` (at most 20). Computed where ``raw`` is; only the results are copied."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    ks = [min(k, 20) for k in ks]
    chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [SampleLogprobs(chosen[r], top_i[r][:k], top_v[r][:k]) for r, k in enumerate(ks)]


def sample_rows(
    logits: torch.Tensor, states: Sequence[RowState], positions: Sequence[int]
) -> tuple[list[int], list[SampleLogprobs | None]]:
    """A step's sampled rows (row i is ``states[i]``'s, for its output token ``positions[i]``)
    where the logits are: the raw rows of the requests that asked for logprobs kept aside, every
    feature's processor, one batched draw; then the ids (and logprobs) copied to the host.
    Changes ``logits`` in place."""
    asking = [i for i, st in enumerate(states) if st.params.logprobs is not None]
    where = logits.device
    at = _on(np.array(asking, dtype=np.int64), where) if asking else None
    raw = logits.index_select(0, at) if at is not None else None
    apply_processors(logits, states)
    batch = make_batch([st.draw for st in states], positions, where)
    drawn = sample(logits, batch)
    lps: list[SampleLogprobs | None] = [None] * len(states)
    if raw is not None:
        ks = [int(states[i].params.logprobs or 0) for i in asking]
        got = logprobs_of(raw, drawn.index_select(0, at), ks)
        for i, lp in zip(asking, got, strict=True):
            lps[i] = lp
    return drawn.tolist(), lps
