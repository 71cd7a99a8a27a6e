"""The output contract of a tensor-parallel HF model.

- ``outputs.loss`` is HF's causal-LM loss (shift, ``ignore_index=-100``, mean over
  non-ignored tokens, or sum / ``num_items_in_batch``) computed from the vocab-parallel logits
  with ``parallel_cross_entropy``: full logits are never materialized for the loss.
- ``outputs.logits`` is gathered over TP and unpadded to ``config.vocab_size``, except in
  training mode with labels, where it is None (the gather costs b*s*V per rank) unless
  ``gather_logits=True``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy
from nxd_hf.parallel_layers.sharding import gather_logical


def parallel_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                            shift_labels=None, **kwargs) -> torch.Tensor:
    """``transformers.loss.loss_utils.ForCausalLMLoss`` on vocab-parallel logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        return parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean",
                                      vocab_size=vocab_size)
    loss = parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum",
                                  vocab_size=vocab_size)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def install_output_contract(model: nn.Module, *, vocab_size: int, gather_logits: bool, sequence_parallel: bool) -> None:
    """Route the loss through ``parallel_cross_entropy`` and gather logits as documented above."""
    model.loss_function = parallel_causal_lm_loss

    def gather_hook(module, args, kwargs, output):
        if getattr(output, "logits", None) is None:
            return output
        labels = kwargs.get("labels")
        if module.training and labels is not None and not gather_logits:
            output.logits = None
        else:
            output.logits = gather_logical(output.logits, None, vocab_size)
        return output

    def check_logits_to_keep(module, args, kwargs):
        keep = kwargs.get("logits_to_keep", 0)
        if sequence_parallel and keep not in (0, None):
            raise ValueError(
                "logits_to_keep (used by generate()) slices the sequence, which sequence parallelism splits "
                "across ranks: parallelize without sequence_parallel=True for generation"
            )

    model.register_forward_pre_hook(check_logits_to_keep, with_kwargs=True)
    model.register_forward_hook(gather_hook, with_kwargs=True)
