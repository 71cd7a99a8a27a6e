"""Sharding metadata carried by every parameter, and the index arithmetic of a shard.

A sharded parameter holds, along ``partition_dim``, the rows ``shard_index`` of the unsharded
(logical) tensor; ``-1`` marks a zero padding row (vocab or head padding). This one description
covers plain, strided (fused), padded and K/V-replicated layouts, so initialization, loading,
gathering and checkpointing all use the same code.
"""

import functools

import torch
from torch import nn

from nxd_hf import backend, parallel_state

TP_ATTRIBUTES = (
    "tensor_model_parallel",  # bool: sharded over the TP group
    "partition_dim",  # int: the sharded dim
    "partition_stride",  # int: fused sub-tensors along partition_dim, each sharded separately
    "logical_size",  # int: unsharded, unpadded size along partition_dim
    "shard_index",  # LongTensor: logical row of each local row, -1 for padding
    "num_replicas",  # int: copies of each logical row across the TP group (replicated K/V)
    "partial_grad_over_tp",  # bool: replicated param whose grad is partial per TP rank (summed over TP)
    "sequence_parallel_enabled",  # bool: NxD's name for partial_grad_over_tp (read as an alias)
    "in_parallel_model",  # bool: a parameter of a model nxd_hf set up (torch's clip_grad_norm_: parallel_layers.torch_clip)
)
EP_ATTRIBUTES = (
    "expert_parallel",  # bool: a fused experts tensor split over the expert-parallel group along dim 0
    "expert_shard_index",  # LongTensor: the logical experts held locally, along dim 0
    "expert_logical_size",  # int: the number of experts in the whole tensor
)


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def padded_size(size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``size``."""
    return -(-size // multiple) * multiple


def contiguous_shard_index(logical_size: int, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """Rows of a contiguously sharded dim, padded at the end to a multiple of ``tp_size``.
    Cached: every layer of the same shape shares one (never modified) index tensor.

    With ``stride`` s the dim is s fused sub-tensors ``[A_1; ...; A_s]``, each split over the
    ranks, so rank r holds ``[A_1,r; ...; A_s,r]`` (Megatron's strided layout); no padding then.
    """
    return _contiguous_shard_index(logical_size, tp_rank, tp_size, stride)  # one cache key per layout


@functools.lru_cache(maxsize=4096)
def _contiguous_shard_index(logical_size: int, tp_rank: int, tp_size: int, stride: int) -> torch.Tensor:
    if stride > 1:
        if logical_size % (stride * tp_size) != 0:
            raise ValueError(
                f"a fused dim of size {logical_size} with stride {stride} must be divisible by "
                f"stride x tensor parallel size = {stride * tp_size}"
            )
        piece = logical_size // (stride * tp_size)
        starts = [(k * tp_size + tp_rank) * piece for k in range(stride)]
        return torch.cat([torch.arange(s, s + piece) for s in starts])
    local = padded_size(logical_size, tp_size) // tp_size
    start, stop = tp_rank * local, (tp_rank + 1) * local
    if stop <= logical_size:
        return torch.arange(start, stop)
    return torch.cat([torch.arange(start, max(start, logical_size)), torch.full((stop - max(start, logical_size),), -1)])


def shard_from_full(full: torch.Tensor, dim: int, shard_index: torch.Tensor) -> torch.Tensor:
    """Select ``shard_index`` rows of ``full`` along ``dim``; -1 rows become zeros."""
    shard_index = shard_index.to(full.device)
    picked = full.index_select(dim, shard_index.clamp(min=0))
    keep_shape = [1] * full.dim()
    keep_shape[dim] = -1
    return picked * (shard_index >= 0).view(keep_shape).to(full.dtype)


def gather_positions(all_indices: list[torch.Tensor], logical_size: int) -> torch.Tensor | None:
    """Where logical row j first appears in the TP all-gather of every rank's shard, or None
    when the gather is already in logical order up to trailing padding."""
    gathered = torch.cat(all_indices)
    if torch.equal(gathered[:logical_size], torch.arange(logical_size)):
        return None
    positions = torch.full((logical_size,), -1, dtype=torch.long)
    for p in reversed(range(len(gathered))):  # reversed: the first occurrence wins
        if gathered[p] >= 0:
            positions[gathered[p]] = p
    assert bool((positions >= 0).all()), "every logical row must be held by some rank"
    return positions


def gather_logical(y: torch.Tensor, positions: torch.Tensor | None, logical_size: int) -> torch.Tensor:
    """All-gather the last dim over TP and return it in logical order, padding dropped."""
    from nxd_hf.parallel_layers import mappings

    full = mappings.gather_from_tensor_model_parallel_region(y)
    if positions is not None:
        return full.index_select(-1, positions.to(y.device))
    return full if full.shape[-1] == logical_size else full[..., :logical_size]


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, *, partition_dim: int, logical_size: int, shard_index: torch.Tensor,
    stride: int = 1, num_replicas: int = 1,
) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.logical_size = logical_size
    param.shard_index = shard_index
    param.num_replicas = num_replicas


def mark_partial_grad_over_tp(param: torch.Tensor, enabled: bool = True) -> None:
    """Mark a replicated parameter whose gradient on each TP rank is partial (it saw this rank's
    sequence shard under SP, or this rank's heads or hidden units): the gradient reduction sums
    it over TP."""
    param.partial_grad_over_tp = enabled


def has_partial_grad_over_tp(param: torch.Tensor) -> bool:
    """Whether the gradient reduction sums ``param``'s gradient over TP: marked by
    ``mark_partial_grad_over_tp``, or with NxD's ``param.sequence_parallel_enabled = True``
    (what NxD code sets on norm weights under sequence parallelism)."""
    return bool(getattr(param, "partial_grad_over_tp", False) or getattr(param, "sequence_parallel_enabled", False))


def copy_tensor_model_parallel_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    for name in TP_ATTRIBUTES + EP_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def logical_numel(param: torch.Tensor) -> int:
    """Elements of the whole (unsharded, unpadded) tensor ``param`` is this rank's part of."""
    numel = param.numel()
    if is_expert_parallel(param) and param.shape[0]:
        numel = numel // param.shape[0] * param.expert_logical_size
    if is_sharded(param) and param.shape[param.partition_dim]:
        numel = numel // param.shape[param.partition_dim] * param.logical_size
    return numel


def parameter_counts(params) -> tuple[int, int]:
    """(trainable, all) elements of the model ``params`` are this rank's parts of, each tensor once:
    what the unparallelized model counts, over the stages this rank holds. A weight tied across
    pipeline stages counts on its first holder only; no communication."""
    unique = {id(p): p for p in params if getattr(p, "count_in_grad_norm", True)}.values()
    return (sum(logical_numel(p) for p in unique if p.requires_grad), sum(logical_numel(p) for p in unique))


def gather_full_tensor(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The unsharded, unpadded ``tensor`` (default: ``param`` itself; e.g. ``param.grad``) laid
    out as the TP-sharded ``param``; every rank gets it. Replicated rows (K/V copies) are equal,
    so any copy serves."""
    group = parallel_state.get_tensor_model_parallel_group()
    dim = param.partition_dim
    tensor = param if tensor is None else tensor
    shards = backend.all_gather(tensor.detach(), dim, group).movedim(dim, 0)
    rows = backend.all_gather(param.shard_index.to(shards.device), 0, group)
    full = shards.new_zeros((param.logical_size, *shards.shape[1:]))
    real = rows >= 0
    full[rows[real]] = shards[real]
    return full.movedim(0, dim)


def full_tensor(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The whole (logical) ``tensor`` of ``param`` (default: ``param`` itself; e.g. its grad),
    detached: gathered over TP when ``param`` is sharded (a collective), as is otherwise."""
    tensor = param if tensor is None else tensor
    full = gather_full_tensor(param, tensor) if is_sharded(param) else tensor.detach()
    return gather_experts(param, full) if is_expert_parallel(param) else full


def local_shard(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``'s whole (logical) tensor ``full``: its rows when ``param``
    is sharded (zeros at padding rows), ``full`` itself otherwise; only its experts when it is
    expert-parallel."""
    if is_expert_parallel(param):
        full = full.index_select(0, param.expert_shard_index.to(full.device))
    return shard_from_full(full, param.partition_dim, param.shard_index) if is_sharded(param) else full


def new_parameter(data: torch.Tensor, like: torch.Tensor | None = None) -> nn.Parameter:
    """A Parameter holding ``data`` that keeps ``like``'s sharding metadata."""
    param = nn.Parameter(data, requires_grad=True if like is None else like.requires_grad)
    if like is not None:
        copy_tensor_model_parallel_attributes(param, like)
    return param


def move_model_to_device(model: nn.Module, device) -> nn.Module:
    """``model.to(device)`` that keeps the sharding metadata of every parameter (a move to an
    XLA device creates new Parameter objects, which would drop it)."""
    saved = {name: {a: getattr(p, a) for a in TP_ATTRIBUTES + EP_ATTRIBUTES if hasattr(p, a)}
             for name, p in model.named_parameters()}
    model.to(device)
    for name, param in model.named_parameters():
        for attr, value in saved[name].items():
            setattr(param, attr, value)
    return model


def local_rows_mask(shard_index: torch.Tensor) -> torch.Tensor | None:
    """Bool mask of real (non-padding) local rows, or None when there is no padding here."""
    keep = shard_index >= 0
    return None if bool(keep.all()) else keep


def tp_coords() -> tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size()


def set_expert_parallel_attributes(param: torch.Tensor, *, shard_index: torch.Tensor, logical_size: int) -> None:
    """Mark ``param`` as holding the experts ``shard_index`` (along dim 0) of ``logical_size``."""
    param.expert_parallel = True
    param.expert_shard_index = shard_index
    param.expert_logical_size = logical_size


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def gather_experts(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """All experts of ``tensor`` (laid out as the expert-parallel ``param``, TP already gathered),
    concatenated along dim 0 over the expert-parallel group (each rank holds a consecutive block;
    the last one may hold more: LongCat's identity-expert slots, ``moe/ep_dispatch.py``)."""
    group = parallel_state.get_expert_parallel_group()
    device = backend.collective_device(group)
    ep = parallel_state.get_expert_parallel_size()
    size, local, rank = param.expert_logical_size, len(param.expert_shard_index), parallel_state.get_expert_parallel_rank()
    block = local if rank == 0 else int(param.expert_shard_index[0]) // rank  # rank r's block starts at r * block
    if block * ep == size:
        return backend.all_gather(tensor.detach().to(device), 0, group).to(tensor.device)
    last = size - block * (ep - 1)  # blocks of ``block`` rows, the last ``last``: pad to it, gather, trim
    padded = tensor.detach().to(device).new_zeros((last, *tensor.shape[1:]))
    padded[:local] = tensor.detach().to(device)
    parts = backend.all_gather(padded, 0, group).split(last)
    return torch.cat([part[: block if r < ep - 1 else last] for r, part in enumerate(parts)]).to(tensor.device)
