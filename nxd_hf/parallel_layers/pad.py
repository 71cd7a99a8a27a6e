"""Attention-head padding so any head count runs at any TP degree (NxD's ``parallel_layers.pad``).

``pad_model`` re-lays the head dim of every ColumnParallelLinear (output) and RowParallelLinear
(input) in scope as ``n_heads + extra`` heads, real heads first and zero heads last, sharded
contiguously. Padded rows are zero and the row-parallel layer masks its padded inputs, so
outputs, losses and gradients equal the unpadded model's and padded weights stay zero in
training. Unlike NxD, which pads the local weight by a ratio, this works on layers in any state
(built at any TP size): the logical weight is gathered, padded and re-sharded.
GQAQKVColumnParallelLinear pads its query heads itself and is left alone.
"""

from collections.abc import Callable

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.heads import padded_head_rows
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from nxd_hf.parallel_layers.sharding import (
    gather_full_tensor, gather_positions, new_parameter, shard_from_full, tp_coords,
)


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """Zero heads to add so ``tp_degree`` divides the head count."""
    return 0 if n_head % tp_degree == 0 else tp_degree - n_head % tp_degree


def _repad(layer: nn.Module, dim: int, logical_size: int, n_heads: int, extra: int) -> list[torch.Tensor]:
    tp_rank, tp_size = tp_coords()
    all_indices = padded_head_rows(n_heads, n_heads + extra, logical_size // n_heads, tp_size)
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        if param is None or not getattr(param, "tensor_model_parallel", False):
            continue  # a row-parallel bias is replicated
        full = gather_full_tensor(param)
        local = shard_from_full(full, dim if name == "weight" else 0, all_indices[tp_rank])
        new = new_parameter(local.to(param.dtype), like=param)
        new.shard_index = all_indices[tp_rank]
        setattr(layer, name, new)
    return all_indices


def pad_model(model: nn.Module, tp_degree: int, n_heads: int, wrapped_classes=(), pad_hook_fn: Callable | None = None) -> nn.Module:
    """Pad the attention heads of ``model`` (in place) so ``tp_degree`` divides them.

    ``wrapped_classes``: only parallel layers inside instances of these classes are padded. When
    empty (NxD's default), every parallel layer whose sharded dim is a whole number of
    ``n_heads`` heads is padded and the others (an MLP of another width, a fused layer) are left
    as they are: they already run at this TP degree. ``pad_hook_fn(module, tgt_src_ratio)`` is called on each wrapped instance (on
    ``model`` when none are given), e.g. to update a cached head count.
    """
    tp_size = parallel_state.get_tensor_model_parallel_size()
    if tp_size not in (1, tp_degree):
        raise ValueError(f"pad_model(tp_degree={tp_degree}) but the tensor parallel size is {tp_size}; pass {tp_size}")
    extra = get_number_of_extra_heads(n_heads, tp_degree)
    wrapped_classes = tuple(wrapped_classes)
    roots = [m for m in model.modules() if isinstance(m, wrapped_classes)] if wrapped_classes else [model]
    ratio = (n_heads + extra) / n_heads
    seen = set()
    for root in roots:
        for layer in root.modules():
            if id(layer) in seen or not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                continue
            seen.add(id(layer))
            if extra and (wrapped_classes or _head_shaped(layer, n_heads)):
                _pad_layer(layer, n_heads, extra)
        if pad_hook_fn is not None:
            pad_hook_fn(root, ratio)
    return model


def _head_shaped(layer: nn.Module, n_heads: int) -> bool:
    size = layer.output_size if isinstance(layer, ColumnParallelLinear) else layer.input_size
    return size % n_heads == 0 and layer.stride == 1


def _pad_layer(layer: nn.Module, n_heads: int, extra: int) -> None:
    if isinstance(layer, ColumnParallelLinear):
        if layer.output_size % n_heads or layer.stride != 1:
            raise ValueError(
                f"pad_model: {layer} has {layer.output_size} outputs, not a whole number of {n_heads} heads "
                "(fused layers need a pad_hook_fn or GQAQKVColumnParallelLinear)"
            )
        all_indices = _repad(layer, 0, layer.output_size, n_heads, extra)
        layer.output_size_per_partition = len(all_indices[0])
        layer._gather_positions = gather_positions(all_indices, layer.output_size)
    else:
        if layer.input_size % n_heads or layer.stride != 1:
            raise ValueError(f"pad_model: {layer} has {layer.input_size} inputs, not a whole number of {n_heads} heads")
        all_indices = _repad(layer, 1, layer.input_size, n_heads, extra)
        tp_rank, _ = tp_coords()
        layer.input_size_per_partition = len(all_indices[0])
        layer.set_input_padding(all_indices[tp_rank])
