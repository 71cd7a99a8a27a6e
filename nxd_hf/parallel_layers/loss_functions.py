"""Cross-entropy over vocab-parallel logits (NxD's ``parallel_cross_entropy``).

Never gathers the logits: three small collectives per call over the TP group (a max, then
one all-reduce of the stacked sum-of-exp, target-logit and sum-of-logits terms).
"""

from typing import Literal

import torch
import torch.nn.functional as F

from nxd_hf import backend, parallel_state
from nxd_hf.guards import device_checks


def vocab_parallel_softmax(z: torch.Tensor, labels: torch.Tensor, label_smoothing: float, ignore_index: int,
                           vocab_size: int):
    """The forward of the vocab-parallel cross-entropy on this rank's fp32 logits ``z [..., V/tp]``
    (overwritten): per-token ``lse(z) - (1 - eps) z_y - eps mean_c(z_c)`` over the real vocab,
    all-reducing a max and three sums on the TP group. Returns the loss and what
    ``grad_of_logits`` needs (the softmax lives in ``z``'s storage)."""
    group = parallel_state.get_tensor_model_parallel_group()
    local_vocab = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    columns = torch.arange(start, start + local_vocab, device=z.device)
    real = columns < vocab_size  # padded vocab columns do not exist for the loss
    num_real = max(0, min(local_vocab, vocab_size - start))  # the real columns are a prefix

    if num_real:
        z_max = z[..., :num_real].max(dim=-1).values
    else:
        z_max = torch.full(z.shape[:-1], float("-inf"), dtype=z.dtype, device=z.device)
    backend.all_reduce(z_max, group, op="max")
    shifted = z.sub_(z_max.unsqueeze(-1))  # [..., V/tp]
    shifted[..., num_real:] = float("-inf")

    ignored = labels == ignore_index
    local_label = labels - start
    owned = (local_label >= 0) & (local_label < local_vocab) & ~ignored
    safe_label = local_label.masked_fill(~owned, 0)
    target = shifted.gather(-1, safe_label.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    sum_shifted = shifted[..., :num_real].sum(-1)
    exp = shifted.exp_()  # in place: shifted is not needed again
    sums = torch.stack([exp.sum(-1), target, sum_shifted])
    backend.all_reduce(sums, group)
    sum_exp, target, sum_shifted = sums

    loss = sum_exp.log() - (1.0 - label_smoothing) * target - label_smoothing * sum_shifted / vocab_size
    loss = loss.masked_fill(ignored, 0.0)
    softmax = exp.div_(sum_exp.unsqueeze(-1))
    return loss, (softmax, safe_label, owned, ignored, real)


def grad_of_logits(saved, label_smoothing: float, vocab_size: int, grad_loss) -> torch.Tensor:
    """``d loss / d z`` from ``vocab_parallel_softmax``'s saved values, times ``grad_loss`` per
    token: ``softmax - (1 - eps) onehot - eps / C`` per local column, zero at padded columns and
    ignored tokens; no communication. Written into the softmax's storage."""
    softmax, safe_label, owned, ignored, real = saved
    grad = softmax
    grad.scatter_add_(-1, safe_label.unsqueeze(-1), -(1.0 - label_smoothing) * owned.unsqueeze(-1).to(grad.dtype))
    if label_smoothing:
        grad.sub_(label_smoothing / vocab_size * real.to(grad.dtype))
    grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: ``vocab_parallel_softmax`` (a max and three sums all-reduced on the TP group).
    Backward: ``grad_of_logits``; no communication."""

    @staticmethod
    def forward(ctx, logits, labels, label_smoothing, ignore_index, vocab_size):
        z = logits.float().clone() if logits.dtype == torch.float32 else logits.float()  # the caller's logits stay
        loss, saved = vocab_parallel_softmax(z, labels, label_smoothing, ignore_index, vocab_size)
        ctx.save_for_backward(*saved)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad = grad_of_logits(ctx.saved_tensors, ctx.label_smoothing, ctx.vocab_size, grad_loss.float())
        return grad.to(ctx.dtype), None, None, None, None


def parallel_cross_entropy(
    parallel_logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
    ignore_index: int = -100, reduction: Literal["none", "mean", "sum"] = "none", *, vocab_size: int | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Cross-entropy of vocab-parallel logits ``[..., V/tp]`` against unsharded ``labels [...]``.

    Equal to ``torch.nn.functional.cross_entropy`` on the gathered logits for every reduction:
    "none" (NxD's default: per-token loss, 0 at ignored tokens), "mean" (over non-ignored
    tokens) or "sum". Differences from NxD, on purpose: ``ignore_index`` is honoured, and label
    smoothing follows torch (``(1 - eps) nll + eps * mean_c(-log p_c)``), not NxD's formula.
    ``vocab_size`` (default: all columns) excludes padded vocab columns on the last ranks.
    The input is never modified in place; the loss is computed in fp32.
    ``check_labels``: at tp > 1 every call checks on the device that each label is a token id or
    ``ignore_index`` (``nxd_hf.guards.device_checks``): a label >= ``vocab_size`` matches no rank's
    columns and would give a finite, wrong loss (torch's own kernel raises at tp=1).
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")
    if isinstance(parallel_logits, torch.fx.Proxy):  # the pipeline tracer: one call, its checks and collectives run
        return parallel_logits.tracer.create_proxy(
            "call_function", parallel_cross_entropy, (parallel_logits, labels, label_smoothing, ignore_index, reduction),
            {"vocab_size": vocab_size, "check_labels": check_labels})
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    tp_size = parallel_state.get_tensor_model_parallel_size()
    full_vocab = parallel_logits.shape[-1] * tp_size
    vocab_size = full_vocab if vocab_size is None else vocab_size
    if not full_vocab - parallel_logits.shape[-1] < vocab_size <= full_vocab:
        raise ValueError(f"vocab_size={vocab_size} does not fit logits of {parallel_logits.shape[-1]} x tp {tp_size}")
    if tp_size == 1:  # nothing to reduce across ranks: torch's kernel and reduction, no more work than plain HF
        logits = parallel_logits if vocab_size == full_vocab else parallel_logits[..., :vocab_size]  # padding: no loss
        loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
        return loss.view(labels.shape) if reduction == "none" else loss
    if check_labels:
        device_checks.check_labels(labels, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(parallel_logits, labels, label_smoothing, ignore_index, vocab_size)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (labels != ignore_index).sum()
    return loss


def loss_normalizer(labels: torch.Tensor, num_items_in_batch=None, *, ignore_index: int = -100) -> torch.Tensor:
    """What this rank divides its summed token loss by, so that gradients averaged over data
    parallelism equal those of one batch holding the whole step: the step's count of
    non-ignored (shifted) label tokens over all DP ranks and micro-steps — ``num_items_in_batch``
    when given, else this call's count summed over DP — divided by the number of batch replicas
    (the DP size over the context-parallel size: the cp ranks of a replica share its rows)."""
    if num_items_in_batch is None:
        num_items_in_batch = (labels[..., 1:] != ignore_index).sum().to(torch.float32)
        backend.all_reduce(num_items_in_batch, parallel_state.get_data_parallel_group())
        num_items_in_batch /= parallel_state.get_context_parallel_size()  # its cp ranks count a replica's rows
    count = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=labels.device)
    return count / parallel_state.get_data_parallel_replicas()
