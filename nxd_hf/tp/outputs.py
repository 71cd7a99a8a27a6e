"""The output contract of a tensor-parallel HF model.

- ``outputs.loss`` is HF's causal-LM loss (shift, ``ignore_index=-100``, mean over
  non-ignored tokens, or sum / ``num_items_in_batch``) computed from the vocab-parallel logits
  with ``parallel_cross_entropy``: full logits are never materialized for the loss.
- ``outputs.logits`` is gathered over TP and unpadded to ``config.vocab_size``, except in
  training mode with labels, where it is None (the gather costs b*s*V per rank) unless
  ``gather_logits=True``.
- With ``fused_loss=True``, in training mode with labels the LM head hands its input through
  and the loss is ``fused_linear_cross_entropy`` of the hidden states: the logits are never
  held at all (returned, computed from those hidden states, only with ``gather_logits=True``).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy
from nxd_hf.parallel_layers.sharding import gather_logical


def parallel_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                            shift_labels=None, *, check_labels: bool = True, **kwargs) -> torch.Tensor:
    """``transformers.loss.loss_utils.ForCausalLMLoss`` on vocab-parallel logits."""
    shift_labels = _shift(labels, shift_labels, ignore_index).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction,
                                  vocab_size=vocab_size, check_labels=check_labels)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _shift(labels, shift_labels, ignore_index: int):
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None else shift_labels


def fused_causal_lm_loss(hidden, labels, head: nn.Module, vocab_size: int, num_items_in_batch=None,
                         ignore_index: int = -100, shift_labels=None, *, check_labels: bool = True) -> torch.Tensor:
    """``parallel_causal_lm_loss`` of ``head(hidden)`` (a vocab-parallel ``ColumnParallelLinear``)
    computed by ``fused_linear_cross_entropy``."""
    hidden = head.input_to_region(hidden)  # replicated, full sequence (gathered under SP)
    labels = _shift(labels, shift_labels, ignore_index)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = fused_linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, vocab_size=vocab_size,
                                      ignore_index=ignore_index, reduction=reduction, check_labels=check_labels)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _install_fused_loss(model: nn.Module, head: nn.Module, armed: dict, check_labels: bool) -> None:
    """In training with labels the head returns its input and the loss function takes it."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("fused_loss=True: this model soft-caps its logits (final_logit_softcapping), which a loss "
                         "fused with the LM head cannot apply: parallelize with fused_loss=False")
    head_forward = head.forward

    def forward(x):
        return x if armed["on"] else head_forward(x)

    def loss_function(logits, labels, vocab_size: int, **kwargs):
        if armed["on"]:
            return fused_causal_lm_loss(logits, labels, head, vocab_size, check_labels=check_labels, **kwargs)
        return parallel_causal_lm_loss(logits, labels, vocab_size, check_labels=check_labels, **kwargs)

    head.forward = forward
    model.loss_function = loss_function

    def arm(module, args, kwargs):
        armed["on"] = module.training and kwargs.get("labels") is not None

    model.register_forward_pre_hook(arm, with_kwargs=True)


def install_output_contract(model: nn.Module, *, vocab_size: int, gather_logits: bool, sequence_parallel: bool,
                            head: nn.Module | None = None, fused_loss: bool = False,
                            check_labels: bool = True) -> None:
    """Route the loss through ``parallel_cross_entropy`` (or, with ``fused_loss``, the hidden
    states through ``fused_linear_cross_entropy`` with ``head``) and gather logits as documented
    above; ``check_labels``: the loss checks the labels' range on the device every step."""
    model.loss_function = functools.partial(parallel_causal_lm_loss, check_labels=check_labels)
    armed = {"on": False}
    if fused_loss:
        assert head is not None
        _install_fused_loss(model, head, armed, check_labels)

    def gather_hook(module, args, kwargs, output):
        fused, armed["on"] = armed["on"], False
        if getattr(output, "logits", None) is None:
            return output
        labels = kwargs.get("labels")
        if module.training and labels is not None and not gather_logits:
            output.logits = None
        else:
            logits = head(output.logits) if fused else output.logits  # fused: the head's input
            output.logits = gather_logical(logits, None, vocab_size)
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
