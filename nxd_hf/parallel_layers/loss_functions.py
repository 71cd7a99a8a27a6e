"""Cross-entropy over vocab-parallel logits (NxD's ``parallel_cross_entropy``).

Never gathers the logits: two small collectives per call over the TP group (a max, then one
all-reduce of the stacked sum-of-exp and target-logit terms, and the sum of the logits under
label smoothing).
"""

from typing import Literal

import torch
import torch.nn.functional as F

from nxd_hf import backend, parallel_state
from nxd_hf.guards import device_checks


def soft_capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in fp32 (Gemma's ``final_logit_softcapping``); the
    logits as they are for ``softcap`` 0."""
    return softcap * torch.tanh(logits.float() / softcap) if softcap else logits


def local_columns(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int):
    """This rank's view of the vocabulary: the number of real columns of ``logits [..., V/tp]``
    (a prefix; the rest is padding), and per token whether its label is ignored, whether this
    rank owns its column, and that column (0 where not owned)."""
    local_vocab = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    num_real = max(0, min(local_vocab, vocab_size - start))
    ignored = labels == ignore_index
    local_label = labels - start
    owned = (local_label >= 0) & (local_label < local_vocab) & ~ignored
    return num_real, ignored, owned, local_label.masked_fill(~owned, 0)


def vocab_parallel_softmax(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float, ignore_index: int,
                           vocab_size: int):
    """The forward of the vocab-parallel cross-entropy on this rank's logits ``[..., V/tp]`` (any
    float dtype, not modified): per-token ``lse(z) - (1 - eps) z_y - eps mean_c(z_c)`` over the
    real vocab in fp32, all-reducing a max and two sums (three with label smoothing) on the TP
    group. Returns the loss and what ``grad_of_logits`` needs: ``exp(z - max)`` in one fresh fp32
    buffer (the upcast and the shift are one pass; everything after works in place)."""
    group = parallel_state.get_tensor_model_parallel_group()
    num_real, ignored, owned, safe_label = local_columns(logits, labels, vocab_size, ignore_index)
    if num_real:  # the max in the logits' own dtype: upcasting is exact
        z_max = logits[..., :num_real].amax(dim=-1).float()
    else:
        z_max = torch.full(logits.shape[:-1], float("-inf"), dtype=torch.float32, device=logits.device)
    backend.all_reduce(z_max, group, op="max")
    shifted = logits - z_max.unsqueeze(-1)  # [..., V/tp], a new fp32 buffer
    if num_real < logits.shape[-1]:
        shifted[..., num_real:] = float("-inf")  # padded columns do not exist for the loss
    target = shifted.gather(-1, safe_label.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    terms = [target, shifted[..., :num_real].sum(-1)] if label_smoothing else [target]
    exp = shifted.exp_()  # in place: shifted is not needed again
    sums = torch.stack([exp.sum(-1), *terms])
    backend.all_reduce(sums, group)

    loss = sums[0].log() - (1.0 - label_smoothing) * sums[1]
    if label_smoothing:
        loss = loss - label_smoothing * sums[2] / vocab_size
    loss = loss.masked_fill(ignored, 0.0)
    return loss, (exp, sums[0], safe_label, owned, ignored, num_real)


def grad_of_logits(saved, label_smoothing: float, vocab_size: int, grad_loss, dtype: torch.dtype = torch.float32):
    """``d loss / d z`` from ``vocab_parallel_softmax``'s saved values, times ``grad_loss`` per
    token: ``softmax - (1 - eps) onehot - eps / C`` per local column, zero at padded columns and
    ignored tokens; no communication. Computed in fp32 in the saved buffer, in one pass after the
    (tiny) one-hot update: ``(exp - (1 - eps) S onehot - eps/C S) * grad / S`` with ``S`` the sum of
    ``exp``; returned in ``dtype`` (fp32: the saved buffer itself)."""
    exp, sum_exp, safe_label, owned, ignored, num_real = saved
    exp.scatter_add_(-1, safe_label.unsqueeze(-1), (-(1.0 - label_smoothing) * sum_exp * owned).unsqueeze(-1))
    if label_smoothing:
        exp[..., :num_real].sub_((label_smoothing / vocab_size) * sum_exp.unsqueeze(-1))
    scale = (grad_loss * ~ignored / sum_exp).unsqueeze(-1)
    return torch.mul(exp, scale, out=exp if dtype == torch.float32 else torch.empty_like(exp, dtype=dtype))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: ``vocab_parallel_softmax`` (a max and the stacked sums all-reduced on the TP
    group). Backward: ``grad_of_logits``; no communication."""

    @staticmethod
    def forward(ctx, logits, labels, label_smoothing, ignore_index, vocab_size):
        loss, saved = vocab_parallel_softmax(logits, labels, label_smoothing, ignore_index, vocab_size)
        ctx.save_for_backward(*saved[:-1])
        ctx.num_real = saved[-1]
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved = (*ctx.saved_tensors, ctx.num_real)
        return grad_of_logits(saved, ctx.label_smoothing, ctx.vocab_size, grad_loss.float(), ctx.dtype), None, None, None, None


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
