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
  What the model's forward does to its logits between the head and the loss is then done to the
  hidden states, so it is checked on autograd's graph each step: a scale by a number (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``) commutes with a head without bias; Gemma's
  soft-capping (``final_logit_softcapping``) is switched off in the config for that forward and
  applied by the fused loss; anything else is refused with a ValueError.
- Within ``label_smoothing(eps)`` the causal-LM loss smooths its labels by ``eps`` (both ways):
  ``Trainer``'s ``label_smoothing_factor``, which ``NxDTrainer`` computes this way where
  ``Trainer`` would run its ``LabelSmoother`` on the full logits.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy
from nxd_hf.parallel_layers.sharding import gather_logical


_LABEL_SMOOTHING = {"epsilon": 0.0}  # a plain dict, not a ContextVar: torch.compile traces a read of it


@contextlib.contextmanager
def label_smoothing(epsilon: float):
    """The causal-LM losses of this contract computed within smooth their labels by ``epsilon``
    as ``transformers.trainer_pt_utils.LabelSmoother`` does: per token ``(1 - eps) nll + eps
    mean_c(-log p_c)`` over the real vocabulary (torch's ``label_smoothing``), summed and divided
    by ``num_items_in_batch`` (or averaged over the non-ignored tokens)."""
    before, _LABEL_SMOOTHING["epsilon"] = _LABEL_SMOOTHING["epsilon"], float(epsilon)
    try:
        yield
    finally:
        _LABEL_SMOOTHING["epsilon"] = before


def parallel_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                            shift_labels=None, *, check_labels: bool = True, **kwargs) -> torch.Tensor:
    """``transformers.loss.loss_utils.ForCausalLMLoss`` on vocab-parallel logits."""
    shift_labels = _shift(labels, shift_labels, ignore_index).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = parallel_cross_entropy(logits, shift_labels, _LABEL_SMOOTHING["epsilon"], ignore_index=ignore_index,
                                  reduction=reduction, vocab_size=vocab_size, check_labels=check_labels)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def whole_vocab(passed: int, logits: torch.Tensor, vocab_size: int, *, fused: bool) -> int:
    """The vocabulary size for the loss: the ``vocab_size`` an HF forward passes is
    ``config.vocab_size``, except where it passes ``logits.shape[-1]`` (Inkling's): under TP that
    is this rank's shard of the logits, with the fused loss the hidden size; the whole
    vocabulary (``vocab_size``, the contract's) is meant."""
    if isinstance(logits, torch.fx.Proxy):  # the pipeline tracer: no shapes (the stages run as traced)
        return passed
    if passed == logits.shape[-1] and (fused or parallel_state.get_tensor_model_parallel_size() > 1):
        return vocab_size
    return passed


def _shift(labels, shift_labels, ignore_index: int):
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None else shift_labels


def fused_causal_lm_loss(hidden, labels, head: nn.Module, vocab_size: int, num_items_in_batch=None,
                         ignore_index: int = -100, shift_labels=None, *, check_labels: bool = True,
                         softcap: float | None = None) -> torch.Tensor:
    """``parallel_causal_lm_loss`` of ``head(hidden)`` (a vocab-parallel ``ColumnParallelLinear``),
    soft-capped at ``softcap`` when given, computed by ``fused_linear_cross_entropy``."""
    hidden = head.input_to_region(hidden)  # replicated, full sequence (gathered under SP)
    labels = _shift(labels, shift_labels, ignore_index)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = fused_linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, vocab_size=vocab_size,
                                      label_smoothing=_LABEL_SMOOTHING["epsilon"], ignore_index=ignore_index,
                                      reduction=reduction, check_labels=check_labels, softcap=softcap)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


_SCALES = ("MulBackward0", "DivBackward0")


def transform_after_head(received: torch.Tensor, returned: torch.Tensor, head_has_bias: bool) -> str | None:
    """What the model did to the head's output ``returned`` before handing ``received`` to its
    loss, when the fused loss cannot take it: None for nothing, or a scale by one number
    (``x * c``, ``x / c``) with a head without bias; else the autograd node that did it. Where
    the graph cannot tell (no gradients reach the hidden states) the tensor is taken as it is."""
    node, target = received.grad_fn, returned.grad_fn
    while received is not returned and node is not None and target is not None and node is not target:
        saved = [getattr(node, name) for name in ("_saved_self", "_saved_other") if type(node).__name__ in _SCALES]
        constants = [t for t in saved if t is not None]
        live = [fn for fn, _ in node.next_functions if fn is not None]
        if not (len(constants) == 1 and constants[0].numel() == 1 and len(live) == 1):  # c / x saves both
            return type(node).__name__
        if head_has_bias:
            return f"{type(node).__name__} (a scale, which does not commute with the head's bias)"
        node = live[0]
    return None


def _set_field(config, name: str, value) -> None:
    """Past the validation of configs that are strict dataclasses (Gemma 3n's types its cap as a
    float, where its forward tests it against None)."""
    object.__setattr__(config, name, value)


def _install_fused_loss(model: nn.Module, head: nn.Module, armed: dict, check_labels: bool, whole: int) -> None:
    """In training with labels the head returns its input and the loss function takes it."""
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    head_forward = head.forward

    def forward(x):
        if not armed["on"]:
            return head_forward(x)
        armed["returned"] = x
        return x

    def loss_function(logits, labels, vocab_size: int, **kwargs):
        if not armed["on"]:
            return parallel_causal_lm_loss(logits, labels, whole_vocab(vocab_size, logits, whole, fused=False),
                                           check_labels=check_labels, **kwargs)
        returned = armed.pop("returned", None)
        found = None if torch.compiler.is_compiling() or returned is None else transform_after_head(
            logits, returned, head.bias is not None)
        if found:
            raise ValueError(f"fused_loss=True: {type(model).__name__}'s forward transforms its logits between the LM "
                             f"head and the loss ({found}), which the fused loss would apply to the hidden states: "
                             "parallelize with fused_loss=False")
        return fused_causal_lm_loss(logits, labels, head, whole_vocab(vocab_size, logits, whole, fused=True),
                                    check_labels=check_labels, softcap=softcap, **kwargs)

    head.forward = forward
    model.loss_function = loss_function

    def arm(module, args, kwargs):
        armed["on"] = module.training and kwargs.get("labels") is not None
        if armed["on"] and softcap:  # HF's forward would cap the hidden states; the fused loss caps the logits
            _set_field(text_config, "final_logit_softcapping", None)

    def disarm(module, args, kwargs, output):
        armed.pop("returned", None)
        _set_field(text_config, "final_logit_softcapping", softcap)

    model.register_forward_pre_hook(arm, with_kwargs=True)
    model.register_forward_hook(disarm, with_kwargs=True, always_call=True)
    armed["softcap"] = softcap


def install_output_contract(model: nn.Module, *, vocab_size: int, gather_logits: bool, sequence_parallel: bool,
                            head: nn.Module | None = None, fused_loss: bool = False,
                            check_labels: bool = True) -> None:
    """Route the loss through ``parallel_cross_entropy`` (or, with ``fused_loss``, the hidden
    states through ``fused_linear_cross_entropy`` with ``head``) and gather logits as documented
    above; ``check_labels``: the loss checks the labels' range on the device every step."""
    whole = vocab_size

    def loss_function(logits, labels, vocab_size: int, **kwargs):
        return parallel_causal_lm_loss(logits, labels, whole_vocab(vocab_size, logits, whole, fused=False),
                                       check_labels=check_labels, **kwargs)

    model.loss_function = loss_function
    armed = {"on": False}
    if fused_loss:
        assert head is not None
        _install_fused_loss(model, head, armed, check_labels, whole)

    def gather_hook(module, args, kwargs, output):
        fused, armed["on"] = armed["on"], False
        if getattr(output, "logits", None) is None:
            return output
        labels = kwargs.get("labels")
        if module.training and labels is not None and not gather_logits:
            output.logits = None
        else:
            logits = head(output.logits) if fused else output.logits  # fused: the head's input
            if fused and armed.get("softcap"):  # as HF's forward caps them
                logits = torch.tanh(logits / armed["softcap"]) * armed["softcap"]
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
    model._nxd_causal_lm_loss = True


def has_causal_lm_loss(model: nn.Module) -> bool:
    """Whether ``model`` (or the base of a peft model) computes its loss through this contract."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_nxd_causal_lm_loss", False)
