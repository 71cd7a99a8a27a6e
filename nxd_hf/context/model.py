"""Context parallelism on an HF causal LM: the forward splits the sequence, attention runs
across the CP group, and the loss is the one-device loss.

Every CP rank of a replica calls the model with the same full batch (as the TP ranks do). A
forward pre-hook then, before anything runs:
- shifts the labels (HF's causal-LM shift, on the full sequence: the label of each rank's last
  token is the first token of the next chunk) and counts the batch's label tokens;
- pads the sequence at the end to a multiple of 2 x cp (x tp, for sequence parallelism);
- keeps this rank's two chunks (``nxd_hf.context.split``) of input_ids / inputs_embeds,
  position_ids (the real positions: rotary embeddings see them) and the shifted labels;
- records the batch's masking facts for attention (``ContextBatch``).

The loss is each rank's token-loss sum over the batch's label count, summed over CP
(``ContextLossSum``): the value is the one-device loss on every CP rank.
"""

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.guards.fingerprint import fingerprint
from nxd_hf.context.attention import IMPLEMENTATIONS, check_heads, current_batch, register, set_batch
from nxd_hf.context.split import (IGNORE_INDEX, ContextBatch, documents, pad_to_multiple, shift_labels,
                                  split_sequence)


class ContextLossSum(torch.autograd.Function):
    """All-reduce (sum) over the context-parallel group forward; backward, the gradient times cp:
    gradients are averaged over the data-parallel group, which holds the cp ranks of each replica,
    while their losses are parts of one sum (Megatron scales its loss by cp likewise)."""

    @staticmethod
    def forward(ctx, loss, group):
        ctx.cp_size = backend.group_size(group)
        return backend.all_reduce(loss.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp_size, None


def resolve_attention(kind: str) -> str:
    """"auto": ring, which takes any head count and holds one (s/cp)^2 score block at a time
    (the all-to-all attention holds the whole s^2 scores of its heads)."""
    return "ring" if kind == "auto" else kind


def install_context_parallel(model: nn.Module, *, kind: str, sequence_parallel: bool = False) -> None:
    """Make ``model`` (already tensor-parallel, if at all) context-parallel over the CP group."""
    cp_size = parallel_state.get_context_parallel_size()
    if cp_size == 1:
        return
    kind = resolve_attention(kind)
    tp_size = parallel_state.get_tensor_model_parallel_size()
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "head_dim"):
            heads = getattr(module, "num_heads", None) or module.config.num_attention_heads // tp_size
            check_heads(kind, heads, cp_size, tp_size)
    register()
    unsplit = {"generating": False}
    _generate_unsplit(model, unsplit)
    model.set_attn_implementation(IMPLEMENTATIONS[kind])
    multiple = 2 * cp_size * (tp_size if sequence_parallel else 1)
    model.context_parallel_multiple = multiple  # the pipeline splits its step's inputs itself (pipeline.context)
    model.register_forward_pre_hook(_split_hook(multiple, unsplit), with_kwargs=True, prepend=True)
    model.register_forward_hook(_gather_logits(unsplit))
    _wrap_loss(model)


def _generate_unsplit(model: nn.Module, unsplit: dict) -> None:
    """``model.generate`` runs unsplit: every CP rank computes the whole sequence with the
    attention the model had before (a KV cache holds every token, and decoding adds one token at a
    time, which cannot be cut into 2 x cp chunks). Exact, and the same tokens on every CP rank;
    the sequence's memory is not divided in generation. A model that does not generate (a
    sequence classifier) is left as it is."""
    generate, attention = getattr(model, "generate", None), model.config._attn_implementation
    if generate is None:
        return

    def generate_unsplit(*args, **kwargs):
        cp_attention = model.config._attn_implementation
        unsplit["generating"] = True
        model.set_attn_implementation(attention)
        try:
            return generate(*args, **kwargs)
        finally:
            unsplit["generating"] = False
            model.set_attn_implementation(cp_attention)

    model.generate = generate_unsplit


def _split_hook(multiple: int, unsplit: dict):
    checked = []

    def split(module, args, kwargs):
        if unsplit["generating"]:
            return args, kwargs
        if args:
            raise ValueError("a context-parallel model takes its inputs by name (input_ids=..., labels=...)")
        if not checked:  # the first forward: a batch split as under data parallelism would train silently wrong
            check_same_batch(kwargs)
            checked.append(True)
        return args, split_inputs(kwargs, multiple, packed=not _builds_cache(module, kwargs))

    return split


def _builds_cache(model: nn.Module, kwargs: dict) -> bool:
    """Whether the one-device forward would build a KV cache: HF then reads no packed documents
    from the position ids (``masking_utils._preprocess_mask_arguments``) and attends across them."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", False) and not (
            model.training and getattr(model, "is_gradient_checkpointing", False))
    return bool(use_cache)


def check_same_batch(kwargs: dict) -> None:
    """ValueError on every CP rank unless they all got the same batch."""
    tensors = {k: v for k, v in kwargs.items() if torch.is_tensor(v) and k in _BATCH_KEYS}
    if not tensors:
        return
    group = parallel_state.get_context_parallel_group()
    mine = fingerprint(tensors, backend.collective_device(group))
    everyone = backend.all_gather(mine, 0, group).view(-1, mine.numel())
    if not bool((everyone == everyone[0]).all()):
        raise ValueError("the context-parallel ranks of a replica got different batches: every CP rank must pass the "
                         "same full sequences (the model splits them), as tensor-parallel ranks do. Split the data "
                         "over parallel_state.get_data_parallel_replicas() replicas "
                         "(rank parallel_state.get_data_parallel_replica_rank()), not over the data-parallel ranks")


_BATCH_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids", "shift_labels")


def _gather_logits(unsplit: dict):
    def gather(module, args, output):
        """Outside autograd in evaluation (``Trainer.evaluate``/``predict``, ``torch.no_grad``), the
        logits of the whole sequence, in order, on every CP rank; in training this rank's chunks."""
        logits = getattr(output, "logits", None)
        if logits is None or module.training or torch.is_grad_enabled() or unsplit["generating"]:
            return output
        output.logits = current_batch().gather(logits, parallel_state.get_context_parallel_group())
        return output

    return gather


def split_inputs(kwargs: dict, multiple: int, *, packed: bool = True) -> dict:
    """The full-batch keyword inputs -> this rank's (module docstring). ``packed``: read packed
    documents from the position ids when there is no attention mask (as HF does without a cache)."""
    cp_rank, cp_size = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_size()
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("a context-parallel model's forward does not take a KV cache: generate with "
                         "model.generate(...), which runs unsplit on every CP rank")
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("a context-parallel model needs input_ids or inputs_embeds")
    rows, seq_len = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"context parallelism takes a 2D attention_mask [batch, seq] (got {mask.dim()}D): pass the "
                         "padding mask, or packed sequences as position_ids restarting at 0 for each document")
    positions = kwargs.get("position_ids")
    if positions is None:  # HF's default in training: 0..S-1 whatever the mask
        positions = torch.arange(seq_len, device=tokens.device).expand(rows, seq_len)
    out = dict(kwargs, use_cache=False, attention_mask=None)
    labels = kwargs.get("shift_labels")
    if labels is None and kwargs.get("labels") is not None:
        labels = shift_labels(kwargs["labels"])
    if labels is not None:
        if out.get("num_items_in_batch") is None:  # the one-device mean: over the whole batch's tokens
            out["num_items_in_batch"] = (labels != IGNORE_INDEX).sum()
        labels = pad_to_multiple(labels, multiple, IGNORE_INDEX)
        out["labels"] = out["shift_labels"] = split_sequence(labels, cp_rank, cp_size)
    key_valid = None if mask is None or bool(mask.all()) else pad_to_multiple(mask.bool(), multiple, None)
    # as HF: packing is read from positions without a mask (and without a cache)
    doc = documents(positions) if mask is None and packed else None
    padded = pad_to_multiple(positions, multiple, None)
    set_batch(ContextBatch(seq_len=padded.shape[1], num_tokens=seq_len, cp_rank=cp_rank, cp_size=cp_size,
                           device=tokens.device,
                           doc=None if doc is None else pad_to_multiple(doc, multiple, None), key_valid=key_valid))
    out["position_ids"] = split_sequence(padded, cp_rank, cp_size)
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            out[name] = split_sequence(pad_to_multiple(kwargs[name], multiple, None), cp_rank, cp_size)
    return out


def _wrap_loss(model: nn.Module) -> None:
    """The model's loss (HF's, or the tensor-parallel one) made the sum over CP of each rank's
    token-loss sum / the batch's label count."""
    local_loss = model.loss_function
    group = parallel_state.get_context_parallel_group()

    def loss_function(logits, labels, vocab_size, **kwargs):
        assert kwargs.get("num_items_in_batch") is not None, "split_inputs sets it"
        return ContextLossSum.apply(local_loss(logits, labels, vocab_size, **kwargs), group)

    model.loss_function = loss_function


def router_token_mask(num_tokens: int) -> torch.Tensor:
    """The mask of the router logits' ``num_tokens`` tokens (this rank's, flattened) that HF's
    load-balancing loss counts: the batch's real, unmasked tokens (``nxd_hf.moe.replica_aux``
    sums their statistics over the data x context group, so the loss is the whole sequence's)."""
    batch = current_batch()
    assert num_tokens % (2 * batch.chunk) == 0, (num_tokens, batch.chunk)
    return batch.token_mask(num_tokens // (2 * batch.chunk)).reshape(-1)
