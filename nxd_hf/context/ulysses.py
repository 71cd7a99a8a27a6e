"""All-to-all (Ulysses) context-parallel attention: trade the sequence split for a head split.

Q/K/V [b, h, s/cp, d] go through one all-to-all over the context-parallel group to
[b, h/cp, s, d] (every token, a cp-th of the heads), attention runs over the whole sequence,
and a second all-to-all brings the output back to [b, h, s/cp, d]. The gathered sequence is in
CP-rank order (each rank's two chunks); the mask (``ContextBatch.gathered_mask``) is built for
that order, so no reordering is needed. Needs the local heads (after tensor parallelism)
divisible by cp; K/V heads that are not are repeated to the query heads first.
"""

import torch

from nxd_hf import backend
from nxd_hf.context.split import ContextBatch


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s/cp, d] -> [b, h/cp, s, d] (group-rank order along the sequence)."""
    cp = backend.group_size(group)
    b, h, s, d = x.shape
    rows = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).reshape(cp * b, h // cp, s, d)
    got = backend.all_to_all(rows, [b] * cp, [b] * cp, group)  # [cp * b, h/cp, s, d], rank j's tokens j-th
    return got.reshape(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h/cp, s, d] -> [b, h, s/cp, d]: the inverse of ``_heads_to_sequence``."""
    cp = backend.group_size(group)
    b, hc, seq, d = x.shape
    rows = x.reshape(b, hc, cp, seq // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * b, hc, seq // cp, d)
    got = backend.all_to_all(rows, [b] * cp, [b] * cp, group)  # [cp * b, h/cp, s/cp, d], rank j's heads j-th
    return got.reshape(cp, b, hc, seq // cp, d).transpose(0, 1).reshape(b, cp * hc, seq // cp, d)


class HeadsToSequence(torch.autograd.Function):
    """All-to-all over the context-parallel group, heads split and sequence gathered, forward;
    the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad.contiguous(), ctx.group), None


class SequenceToHeads(torch.autograd.Function):
    """All-to-all over the context-parallel group, sequence split and heads gathered, forward;
    the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad.contiguous(), ctx.group), None


def masked_attention(q, k, v, mask, scale):
    """Softmax attention with a boolean mask (True: may attend), differentiable, in fp32; a query
    that sees no key gets 0 (not NaN, which would reach every gradient)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs * mask.any(-1)[:, None, :, None]
    return torch.matmul(probs, v.float()).to(q.dtype)


def all_to_all_attention(q, k, v, batch: ContextBatch, scale: float, group) -> torch.Tensor:
    """q [b, hq, s/cp, d], k/v [b, hkv, s/cp, d] -> [b, hq, s/cp, d]."""
    cp = batch.cp_size
    n_rep = q.shape[1] // k.shape[1]
    if k.shape[1] % cp != 0:  # repeat K/V to the query heads, which cp divides
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        n_rep = 1
    q, k, v = (HeadsToSequence.apply(t.contiguous(), group) for t in (q, k, v))
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    out = masked_attention(q, k, v, batch.gathered_mask, scale)
    return SequenceToHeads.apply(out.contiguous(), group)
