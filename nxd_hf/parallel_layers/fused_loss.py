"""Cross-entropy straight from the hidden states: the LM head's matmul fused into the loss, in
chunks of tokens, so the full ``[tokens, V/tp]`` logits never exist at once (as Liger's fused
linear cross-entropy, but vocab-parallel).

In training the gradients are computed during the forward, chunk by chunk: each chunk's logits
are made, turned into the loss and ``d loss / d logits`` (``vocab_parallel_softmax``, its
collectives included), and that is multiplied straight into the hidden states' and the head's
gradients; the logits are then dropped. Backward only scales the stored gradients by the
incoming one, so no matmul is done twice (recomputing the logits in backward cost a third
matmul). Without gradients the chunks give the loss alone.
"""

import torch
import torch.nn.functional as F

from nxd_hf import parallel_state
from nxd_hf.guards import device_checks
from nxd_hf.parallel_layers.loss_functions import grad_of_logits, parallel_cross_entropy, vocab_parallel_softmax

CHUNK_ELEMENTS = 2**25  # logits per chunk: 128 MiB in fp32, whatever the vocabulary


def _chunk_logits(hidden, weight, bias) -> torch.Tensor:
    return F.linear(hidden, weight, bias).float()  # [chunk, V/tp], a fresh fp32 buffer the loss may overwrite


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss, with ``d loss / d (hidden, weight, bias)`` accumulated chunk by
    chunk (fp32 for the head's, as one matmul would accumulate). Backward: those times the
    incoming scalar; no communication (the hidden states' TP all-reduce is the caller's region)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, label_smoothing, ignore_index, vocab_size, chunk):
        tp_size = parallel_state.get_tensor_model_parallel_size()
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h, y = hidden[rows], labels[rows]
            z = _chunk_logits(h, weight, bias)
            if tp_size == 1:  # softmax - onehot by torch's kernels, as F.cross_entropy's backward
                z = z[:, :vocab_size].detach().requires_grad_()
                with torch.enable_grad():
                    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum",
                                           label_smoothing=label_smoothing)
                    (d_logits,) = torch.autograd.grad(loss, z)
                if vocab_size < weight.shape[0]:  # padded head rows: no gradient
                    d_logits = F.pad(d_logits, (0, weight.shape[0] - vocab_size))
            else:
                token_loss, saved = vocab_parallel_softmax(z, y, label_smoothing, ignore_index, vocab_size)
                loss = token_loss.sum()
                d_logits = grad_of_logits(saved, label_smoothing, vocab_size, torch.ones((), device=z.device))
            total += loss.detach()
            d_logits = d_logits.to(weight.dtype)
            if want_hidden:
                torch.mm(d_logits, weight, out=grad_hidden[rows])
            if want_weight and weight.dtype == torch.float32:
                grad_weight.addmm_(d_logits.t(), h)  # in place: no [V/tp, h] temporary per chunk
            elif want_weight:
                grad_weight.add_(d_logits.t() @ h)  # the chunk's matmul in the head's dtype, summed in fp32
            if want_bias:
                grad_bias.add_(d_logits.float().sum(0))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_total.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * scale).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = (grad_bias * scale).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: torch.Tensor | None = None,
    vocab_size: int | None = None, label_smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
    chunk_tokens: int | None = None, check_labels: bool = True,
) -> torch.Tensor:
    """``parallel_cross_entropy(F.linear(hidden, weight, bias), labels, ...)`` without holding the
    logits: ``hidden [..., h]`` as every TP rank's head sees it (replicated, full sequence),
    ``weight [V/tp, h]`` this rank's vocabulary rows, ``labels [...]`` unsharded. ``reduction``
    "sum" or "mean" (over non-ignored tokens); ``chunk_tokens`` default: ``CHUNK_ELEMENTS`` logits;
    ``check_labels`` as ``parallel_cross_entropy``'s."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'mean' or 'sum', not {reduction!r}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    tp_size = parallel_state.get_tensor_model_parallel_size()
    vocab_size = weight.shape[0] * tp_size if vocab_size is None else vocab_size
    if check_labels and tp_size > 1:  # torch's kernel raises at tp=1
        device_checks.check_labels(labels, vocab_size, ignore_index)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        if torch.is_autocast_enabled(hidden.device.type):  # the chunks' matmuls in autocast's dtype, as F.linear's
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            total = _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, label_smoothing, ignore_index,
                                                   vocab_size, chunk)
    else:
        total = sum(parallel_cross_entropy(F.linear(hidden[s:s + chunk], weight, bias), labels[s:s + chunk],
                                           label_smoothing, ignore_index, "sum", vocab_size=vocab_size,
                                           check_labels=False)  # checked once for all chunks
                    for s in range(0, hidden.shape[0], chunk))
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()
