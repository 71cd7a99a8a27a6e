"""Ring attention: exact attention over a sequence split across the context-parallel group.

Each rank keeps its queries; K/V go around the ring (rank r sends to r + 1, receives from
r - 1), cp - 1 hops forward. Block results merge by their log-sum-exp (online softmax):

    O = sum_j exp(lse_j - lse) O_j,    lse = log sum_j exp(lse_j)

Backward runs the ring again: dQ stays, dK/dV travel with their K/V block and, after cp hops,
arrive back at the rank that owns it. Per block, with P = exp(S - lse) and D = rowsum(dO * O):

    dV = P^T dO,   dS = P * (dO V^T - D),   dQ = scale dS K,   dK = scale dS^T Q

K/V travel with their own (fewer, under GQA) heads and are repeated to the query heads per
block. Arithmetic runs in fp32. A block is computed in tiles of ``TILE`` queries x ``TILE`` keys
(``ContextBatch.ring_tiles``: fully masked tiles skipped, masks only where a tile needs one), so
the scores held at once are [b, h, TILE, TILE] whatever the sequence length.
"""

import torch

from nxd_hf import backend
from nxd_hf.context.split import ContextBatch


TILE = 256


def _repeat(kv: torch.Tensor, n_rep: int) -> torch.Tensor:
    return kv if n_rep == 1 else kv.repeat_interleave(n_rep, dim=1)


def _unrepeat(grad: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of ``_repeat``: the query heads' sum per K/V head."""
    if n_rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(2)


def _scores(q, k, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, h, sq, sk]
    return scores if mask is None else scores.masked_fill(~mask[:, None], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query that sees no key) as 0: its probabilities are then exp(-inf) = 0."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def block_forward(q, k, v, mask, scale):
    """Attention of one block: output [b, h, sq, d] and log-sum-exp [b, h, sq]."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return torch.matmul(probs, v), lse


def merge(out, lse, block_out, block_lse):
    """Merge a block's (output, lse) into the running ones, in place."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(torch.exp(block_lse - safe)[..., None] * block_out)
    lse.copy_(new)


def block_backward(q, k, v, mask, scale, lse, grad_out, delta):
    """(dQ, dK, dV) of one block given the final lse and D = rowsum(dO * O)."""
    probs = torch.exp(_scores(q, k, mask, scale) - _finite(lse)[..., None])
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta[..., None])
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    return grad_q, grad_k, grad_v


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over the whole sequence: K/V passed around the
    context-parallel ``group`` by send/recv (forward: cp - 1 hops of K/V; backward: cp - 1 hops
    of K/V and cp hops of dK/dV). ``apply(q, k, v, batch, scale, group)``, q [b, hq, s/cp, d],
    k/v [b, hkv, s/cp, d] with hq a multiple of hkv; returns [b, hq, s/cp, d]."""

    @staticmethod
    def forward(ctx, q, k, v, batch: ContextBatch, scale: float, group):
        n_rep = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.float(), v.float()]
        for step in range(batch.cp_size):
            pending = backend.ring_shift(kv, group) if step < batch.cp_size - 1 else None
            for qs, ks, mask in batch.ring_tiles(step, TILE):
                block_out, block_lse = block_forward(qf[:, :, qs], _repeat(kv[0][:, :, ks], n_rep),
                                                     _repeat(kv[1][:, :, ks], n_rep), mask, scale)
                merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.batch, ctx.scale, ctx.group = batch, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        batch, scale, group = ctx.batch, ctx.scale, ctx.group
        n_rep = q.shape[1] // k.shape[1]
        qf, grad_out = q.float(), grad_out.float()
        delta = (grad_out * out).sum(-1)  # [b, hq, s/cp]
        grad_q = torch.zeros_like(qf)
        kv = [k.float(), v.float()]
        grad_kv = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]
        for step in range(batch.cp_size):
            pending = backend.ring_shift(kv, group) if step < batch.cp_size - 1 else None
            for qs, ks, mask in batch.ring_tiles(step, TILE):
                dq, dk, dv = block_backward(qf[:, :, qs], _repeat(kv[0][:, :, ks], n_rep),
                                            _repeat(kv[1][:, :, ks], n_rep), mask, scale, lse[:, :, qs],
                                            grad_out[:, :, qs], delta[:, :, qs])
                grad_q[:, :, qs] += dq
                grad_kv[0][:, :, ks] += _unrepeat(dk, n_rep)
                grad_kv[1][:, :, ks] += _unrepeat(dv, n_rep)
            # the block's gradients follow it; after the last step they reach the rank owning it
            grad_kv = backend.ring_shift(grad_kv, group).wait()
            if pending is not None:
                kv = pending.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None
