"""Cross-entropy straight from the hidden states: the LM head's matmul fused into the loss, in
chunks of tokens, so the full ``[tokens, V/tp]`` logits never exist at once (as Liger's fused
linear cross-entropy, but vocab-parallel).

In training the gradients are computed during the forward, chunk by chunk: each chunk's logits
are made in the head's dtype, turned into the loss and ``d loss / d logits`` in fp32 — on CUDA by
two Triton kernels that write the gradient over the logits (``softmax_kernels``: each logit read
twice and written once), elsewhere by torch's ops (``vocab_parallel_softmax``, its collectives
included: the upcast, the shift and the exponential are one fp32 buffer written twice, the
gradient one pass more) — and that is multiplied straight into
the hidden states' gradient and added in place into the head's (one ``addmm_`` per chunk, in the
head's dtype as its own matmul would give it, as Liger does: no temporary and no fp32 copy of the
``[V/tp, h]`` weight per chunk); the logits are then dropped. Backward only scales the stored
gradients by the incoming one, in fp32 (a bf16 scale of 1/tokens would be off by up to 0.4%),
so no matmul is done twice. Without gradients the chunks give the loss alone. Soft-capped logits
(Gemma's ``final_logit_softcapping``: ``c * tanh(z / c)``) are capped chunk by chunk, in fp32,
and their gradient taken through the cap.
"""

import torch
import torch.nn.functional as F

from nxd_hf import parallel_state
from nxd_hf.guards import device_checks
from nxd_hf.parallel_layers import softmax_kernels
from nxd_hf.parallel_layers.loss_functions import (
    grad_of_logits, parallel_cross_entropy, soft_capped, vocab_parallel_softmax,
)

CHUNK_ELEMENTS = 2**27
"""Logits per chunk: 256 MiB in bf16 plus their 512 MiB fp32 softmax, whatever the vocabulary
(a 128k vocabulary: 1,046 tokens). Each chunk reads the head's weight twice and its gradient once
and writes that back (``[V/tp, h]`` each): fewer, larger chunks pass over them less often
(``bench/fused_loss/traffic.py``: at the 1B head, 16 chunks moved 69.5 GB, 8 chunks 52.7 GB)."""

KERNEL_CHUNK_BYTES = 2**30
"""Logits per chunk in training with the Triton kernels: 1 GiB of them in their dtype (2^29 in
bf16: 4,185 tokens at a 128k vocabulary), about what ``CHUNK_ELEMENTS`` logits hold with their
fp32 softmax and gradient; the kernels need no other buffer, so half as many passes over the
head's weight and gradient (``bench/fused_loss/traffic.py``)."""


def _scaled_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad *= scale`` in place, computed in fp32 whatever ``grad``'s dtype (``scale`` as a
    one-element tensor takes part in type promotion; a 0-dim one would be rounded to bf16)."""
    return torch.mul(grad, scale.reshape(1), out=grad)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss, with ``d loss / d (hidden, weight, bias)`` accumulated chunk by
    chunk (the bias's in fp32). Backward: those times the incoming scalar; no communication (the
    hidden states' TP all-reduce is the caller's region)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, label_smoothing, ignore_index, vocab_size, chunk, use_kernels,
                softcap):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h, y = hidden[rows], labels[rows]
            if use_kernels:  # the gradient written over the chunk's logits
                d_logits = F.linear(h, weight, bias)
                total += softmax_kernels.loss_and_grad_in_place(d_logits, y, label_smoothing, ignore_index,
                                                                vocab_size, softcap).sum()
            elif softcap:  # z = c tanh(x / c); d z / d x = 1 - tanh^2 (kept in fp32 for it)
                capped = F.linear(h, weight, bias).float().div_(softcap).tanh_()
                token_loss, saved = vocab_parallel_softmax(capped * softcap, y, label_smoothing, ignore_index,
                                                           vocab_size)
                total += token_loss.sum()
                d_capped = grad_of_logits(saved, label_smoothing, vocab_size, one)
                d_logits = d_capped.mul_(capped.square_().neg_().add_(1.0)).to(weight.dtype)
            else:
                token_loss, saved = vocab_parallel_softmax(F.linear(h, weight, bias), y, label_smoothing, ignore_index,
                                                           vocab_size)  # the chunk's logits are freed here
                total += token_loss.sum()
                d_logits = grad_of_logits(saved, label_smoothing, vocab_size, one, weight.dtype)  # [chunk, V/tp]
            if want_hidden:
                torch.mm(d_logits, weight, out=grad_hidden[rows])
            if want_weight:
                grad_weight.addmm_(d_logits.t(), h)
            if want_bias:
                grad_bias.add_(d_logits.sum(0, dtype=torch.float32))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_total.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden = _scaled_(grad_hidden, scale)
        if grad_weight is not None:
            grad_weight = _scaled_(grad_weight, scale)
        if grad_bias is not None:
            grad_bias = (grad_bias * scale).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: torch.Tensor | None = None,
    vocab_size: int | None = None, label_smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
    chunk_tokens: int | None = None, check_labels: bool = True, kernel: str = "auto", softcap: float | None = None,
) -> torch.Tensor:
    """``parallel_cross_entropy(F.linear(hidden, weight, bias), labels, ...)`` without holding the
    logits: ``hidden [..., h]`` as every TP rank's head sees it (replicated, full sequence),
    ``weight [V/tp, h]`` this rank's vocabulary rows, ``labels [...]`` unsharded. ``reduction``
    "sum" or "mean" (over non-ignored tokens); ``chunk_tokens`` default: ``CHUNK_ELEMENTS`` logits
    (``KERNEL_CHUNK_BYTES`` of them in training with the Triton kernels);
    ``check_labels`` as ``parallel_cross_entropy``'s. ``kernel``: how training computes each
    chunk's softmax and gradient: "triton" (``softmax_kernels``: CUDA, or CPU under
    ``TRITON_INTERPRET=1``), "torch" (eager ops, any device) or "auto" (Triton on CUDA where it
    is installed, else torch's ops). ``softcap``: the loss of ``softcap * tanh(logits / softcap)``
    (Gemma's ``final_logit_softcapping``), None for the logits as they are."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy: reduction must be 'mean' or 'sum', not {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fused_linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be a positive number or None, not {softcap!r}")
    softcap = float(softcap or 0.0)
    use_kernels = softmax_kernels.usable(hidden.device, kernel)
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    tp_size = parallel_state.get_tensor_model_parallel_size()
    vocab_size = weight.shape[0] * tp_size if vocab_size is None else vocab_size
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if check_labels and (training or tp_size > 1):  # else torch's kernel raises (tp=1 without gradients)
        device_checks.check_labels(labels, vocab_size, ignore_index)
    if training:
        if torch.is_autocast_enabled(hidden.device.type):  # the chunks' matmuls in autocast's dtype, as F.linear's
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if use_kernels and not chunk_tokens:
            chunk = max(1, KERNEL_CHUNK_BYTES // weight.element_size() // weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            total = _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, label_smoothing, ignore_index,
                                                   vocab_size, chunk, use_kernels, softcap)
    else:
        total = sum(parallel_cross_entropy(soft_capped(F.linear(hidden[s:s + chunk], weight, bias), softcap),
                                           labels[s:s + chunk], label_smoothing, ignore_index, "sum",
                                           vocab_size=vocab_size, check_labels=False)  # checked once for all chunks
                    for s in range(0, hidden.shape[0], chunk))
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()
