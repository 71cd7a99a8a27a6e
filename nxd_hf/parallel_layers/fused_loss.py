"""Cross-entropy straight from the hidden states: the LM head's matmul fused into the loss, in
chunks of tokens, so the full ``[tokens, V/tp]`` logits never exist at once (as Liger's fused
linear cross-entropy, but vocab-parallel).

Each chunk's logits are made, reduced to a summed loss by ``parallel_cross_entropy`` (its
collectives included) and dropped; backward recomputes them one chunk at a time
(``torch.utils.checkpoint``), so the peak is one chunk's logits and softmax instead of all.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nxd_hf.guards import device_checks
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy

CHUNK_ELEMENTS = 2**25  # logits per chunk: 128 MiB in fp32, whatever the vocabulary


def _chunk_loss(hidden, weight, bias, labels, label_smoothing, ignore_index, vocab_size):
    logits = F.linear(hidden, weight, bias)  # [chunk, V/tp]
    return parallel_cross_entropy(logits, labels, label_smoothing, ignore_index, "sum", vocab_size=vocab_size,
                                  check_labels=False)  # checked once for all chunks


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
    if check_labels and vocab_size is not None:
        device_checks.check_labels(labels, vocab_size, ignore_index)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    total = None
    for start in range(0, hidden.shape[0], chunk):
        args = (hidden[start:start + chunk], weight, bias, labels[start:start + chunk], label_smoothing,
                ignore_index, vocab_size)
        if torch.is_grad_enabled():
            loss = checkpoint(_chunk_loss, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            loss = _chunk_loss(*args)
        total = loss if total is None else total + loss
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()
