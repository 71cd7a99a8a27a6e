"""Per-token outputs of this rank's chunks gathered into the whole sequence, with a gradient:
for losses computed outside the model's ``loss_function`` (TRL's fused LM head returns
per-token log-probabilities, and the trainer sums them itself)."""

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.context.attention import current_batch
from nxd_hf.context.split import local_index


class GatherSequence(torch.autograd.Function):
    """All-gather over the context-parallel group forward (every rank's chunks put back in
    sequence order, the end padding dropped); backward, reduce-scatter (sum): every CP rank
    computes the same loss from the whole sequence, so each gets cp x the gradient of its own
    tokens — the factor the data-parallel average over dp x cp ranks takes back out, as
    ``ContextLossSum``'s backward."""

    @staticmethod
    def forward(ctx, local, batch, group):
        ctx.batch, ctx.group = batch, group
        order = _order(batch).to(local.device)
        gathered = backend.all_gather(local.contiguous(), 1, group)  # [b, S_padded, ...], rank-major chunks
        full = torch.empty_like(gathered)
        full[:, order] = gathered
        return full[:, :batch.num_tokens]

    @staticmethod
    def backward(ctx, grad):
        batch = ctx.batch
        padded = grad.new_zeros(grad.shape[0], batch.seq_len, *grad.shape[2:])
        padded[:, :batch.num_tokens] = grad
        rank_major = padded[:, _order(batch).to(grad.device)]
        return backend.reduce_scatter(rank_major.contiguous(), 1, ctx.group), None, None


def _order(batch) -> torch.Tensor:
    return torch.cat([local_index(batch.seq_len, r, batch.cp_size) for r in range(batch.cp_size)])


def gather_sequence(local: torch.Tensor) -> torch.Tensor:
    """``local`` [b, s/cp, ...] (this rank's chunks of the current batch) -> [b, S, ...] in order
    on every CP rank; the identity at cp = 1. Integer and bool tensors travel without a gradient."""
    if parallel_state.get_context_parallel_size() == 1:
        return local
    batch, group = current_batch(), parallel_state.get_context_parallel_group()
    if local.is_floating_point():
        return GatherSequence.apply(local, batch, group)
    with torch.no_grad():
        return GatherSequence.apply(local.to(torch.float64), batch, group).to(local.dtype)
