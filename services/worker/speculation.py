"""Speculative decoding, the worker's half: verifying a sequence's draft tokens in the step
that computes them (the scheduler proposes them: services/scheduler/speculation.py).

A ScheduledSeq with ``num_draft`` = k carries its last known token and k drafts at positions
p .. p + k. ``expand`` lays it out as k + 1 single-token rows, row i attending to positions
<= p + i: every row's K/V is written before any attention of the step reads (both paths), so
row i sees the drafts before it exactly as a later decode step would see them had they been
generated. Each row is a decode row like any other (the same batch-invariant GEMM rows and
decode attention kernel on the CPU, the same CUDA graphs on a GPU), so its logits are bit for
bit those of plain decoding given the same tokens.

Every row is then sampled with the request's own parameters (``x_i``), and ``accept`` keeps
``x_0``, then ``x_{i+1}`` while ``x_i`` equals draft ``d_{i+1}``. This is rejection sampling
with a one-hot draft distribution: the draft is accepted with probability p(d) (the chance
the sample equals it) and, when rejected, the token emitted is the sample itself, which is
distributed as p restricted to tokens other than d, i.e. max(p - q, 0) normalized. Every
emitted token is thus a draw from the target distribution given the tokens before it, so
sampled output keeps its distribution and greedy output is token for token the same as
without speculation.
"""

from __future__ import annotations

from kvflow.shared.messages import ScheduledSeq


def expand(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """``seqs`` with each chunk that carries drafts replaced by one single-token, sampled row
    per token (in position order); other chunks unchanged."""
    if not any(s.num_draft for s in seqs):
        return seqs
    out: list[ScheduledSeq] = []
    for s in seqs:
        if not s.num_draft:
            out.append(s)
            continue
        if not s.sample or s.num_draft >= len(s.token_ids):
            raise ValueError(f"{s.request_id}: drafts must follow a known last token")
        out += [
            ScheduledSeq(s.request_id, [tok], s.start_pos + i, s.block_table)
            for i, tok in enumerate(s.token_ids)
        ]
    return out


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification yields: ``sampled[i]`` is the token sampled after the chunk's
    first i + 1 tokens (its known token, then drafts[:i]); ``len(sampled) == len(drafts) + 1``.
    Keeps sampled[0], then sampled[i + 1] while sampled[i] == drafts[i]."""
    out = [sampled[0]]
    for i, d in enumerate(drafts):
        if sampled[i] != d:
            break
        out.append(sampled[i + 1])
    return out


def kept(s: ScheduledSeq, sampled: list[int]) -> list[int]:
    """The tokens chunk ``s`` yields from the tokens sampled after each of its rows: the one
    sampled token of a plain chunk, or what ``accept`` keeps of a chunk with drafts."""
    if not s.num_draft:
        return sampled[:1]
    return accept(s.token_ids[-s.num_draft :], sampled)
