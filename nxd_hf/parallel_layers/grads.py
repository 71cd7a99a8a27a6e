"""Gradient synchronization and clipping for TP x PP x DP training.

- ``sync_data_parallel_grads``: bucketed all-reduce-mean over the DP group (a few collectives
  per step, not one per parameter); expert-parallel parameters over the expert-data group
  (``data_parallel_mean``).
- ``allreduce_sequence_parallel_gradients``: under sequence parallelism, replicated parameters
  (norm weights, row-parallel biases) see only their rank's sequence chunk; their grads are
  summed over TP (bucketed).
- ``accumulated_grad`` / ``install_fp32_grad_accumulation``: a low-precision parameter may
  accumulate its gradient in an fp32 ``param.main_grad`` (Megatron's name) instead of ``.grad``.
- ``clip_grad_norm``: the norm of the whole model's gradient, equal to
  ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: shards summed over TP and PP,
  TP-replicated parameters counted once (on TP rank 0), each replicated K/V row once
  (``num_replicas``), parameters marked ``count_in_grad_norm = False`` (a tied weight's second
  copy on another pipeline stage) skipped, and DP replicas (identical after sync) not summed;
  expert-parallel parameters summed over the expert-parallel group (each rank holds other experts);
  gradients sharded over the DP ranks by FSDP2 (``nxd_hf.fsdp``: DTensors) summed over their shard
  group (the DP group; experts: the expert-data group).
"""

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp, is_expert_parallel, is_sharded


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's accumulated gradient: the fp32 ``main_grad`` under fp32 accumulation."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    if param.main_grad is None:
        param.main_grad = param.grad.float()
    else:
        param.main_grad.add_(param.grad)
    param.grad = None


def install_fp32_grad_accumulation(params) -> int:
    """After each backward, add the low-precision (bf16/fp16) gradient of each of ``params``
    into an fp32 ``param.main_grad`` and release ``param.grad``, so accumulation over
    micro-steps happens in fp32; returns how many parameters that applies to."""
    count = 0
    for param in params:
        low_precision = param.dtype in (torch.bfloat16, torch.float16)
        if low_precision and param.requires_grad and not hasattr(param, "main_grad"):
            param.main_grad = None
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            count += 1
    return count


def _as_list(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _buckets(tensors: list[torch.Tensor], bucket_size_mb: float) -> list[list[torch.Tensor]]:
    """Consecutive groups of same dtype/device whose total size stays under the bucket size."""
    limit = bucket_size_mb * 1024 * 1024
    buckets, current, current_bytes = [], [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if current and (current_bytes + size > limit or (t.dtype, t.device) != (current[0].dtype, current[0].device)):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(t)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def all_reduce_bucketed(tensors: list[torch.Tensor], group, *, scale: float = 1.0, bucket_size_mb: float = 25) -> None:
    """Sum ``tensors`` in place over ``group`` (then multiply by ``scale``), one flat buffer per bucket."""
    if backend.group_size(group) == 1 or not tensors:
        return
    for bucket in _buckets(tensors, bucket_size_mb):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        backend.all_reduce(flat, group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def sync_data_parallel_grads(parameters: Iterable[torch.Tensor], *, bucket_size_mb: float = 25) -> None:
    """Average gradients over the data-parallel group, in buckets of ``bucket_size_mb``."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    data_parallel_mean(params, [p.grad for p in params], bucket_size_mb=bucket_size_mb)


def data_parallel_mean(params: list[torch.Tensor], grads: list[torch.Tensor], *, bucket_size_mb: float = 25) -> None:
    """``grads`` (of ``params``, in place) averaged over data parallelism: summed over the data
    group and divided by its size; an expert-parallel parameter's over the expert-data group
    (the ranks holding the same experts: the all-to-all's backward already summed the tokens of
    its expert-parallel peers), divided by the data-parallel size all the same."""
    scale = 1.0 / parallel_state.get_data_parallel_size()
    dense = [g for p, g in zip(params, grads) if not is_expert_parallel(p)]
    experts = [g for p, g in zip(params, grads) if is_expert_parallel(p)]
    all_reduce_bucketed(dense, parallel_state.get_data_parallel_group(), scale=scale, bucket_size_mb=bucket_size_mb)
    group = parallel_state.get_expert_data_parallel_group()
    if backend.group_size(group) == 1:  # every data-parallel rank of this block is an expert peer
        for g in experts:
            g.mul_(scale)
    else:
        all_reduce_bucketed(experts, group, scale=scale, bucket_size_mb=bucket_size_mb)


def allreduce_sequence_parallel_gradients(parameters: Iterable[torch.Tensor], *, bucket_size_mb: float = 25) -> None:
    """Sum over TP the grads of replicated parameters marked ``partial_grad_over_tp`` (or NxD's
    ``sequence_parallel_enabled``)."""
    grads = [
        p.grad for p in _as_list(parameters)
        if p.grad is not None and has_partial_grad_over_tp(p) and not is_sharded(p)
    ]
    all_reduce_bucketed(grads, parallel_state.get_tensor_model_parallel_group(), bucket_size_mb=bucket_size_mb)


@torch.no_grad()
def get_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The gradient norm of the whole (unsharded) model; see the module docstring."""
    norm_type = float(norm_type)
    params = _as_list(parameters)
    whole = _whole_grads(params, norm_type)
    if whole is not None:
        return _whole_norm(whole, norm_type)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dense, experts = [], []  # one pass: this runs every step, over every parameter
    for p in params:
        if p.grad is not None and getattr(p, "count_in_grad_norm", True) and (tp_rank == 0 or is_sharded(p)):
            (experts if is_expert_parallel(p) else dense).append(p)
    device = _local((dense or experts)[0].grad).device if dense or experts else backend.collective_device(
        parallel_state.get_model_parallel_group())
    if norm_type == float("inf"):
        total = torch.zeros((), dtype=torch.float32, device=device)
        for p in dense + experts:
            grad = _local(p.grad)
            if grad.numel():
                total = torch.maximum(total, grad.abs().max().float())
        for group in _shard_groups(dense) + _shard_groups(experts):
            backend.all_reduce(total, group, op="max")
        backend.all_reduce(total, parallel_state.get_expert_parallel_group(), op="max")
        backend.all_reduce(total, parallel_state.get_model_parallel_group(), op="max")
        return total
    total = _sharded_power_sum(dense, norm_type, device)
    if parallel_state.get_expert_parallel_size() > 1:  # every rank joins, with or without experts
        experts_total = _sharded_power_sum(experts, norm_type, device)
        total = total + backend.all_reduce(experts_total, parallel_state.get_expert_parallel_group())
    elif experts:
        total = total + _power_sum(experts, norm_type, device)
    backend.all_reduce(total, parallel_state.get_model_parallel_group())
    return total ** (1.0 / norm_type)


def _sharded_power_sum(params: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """``_power_sum`` of ``params``, the parts of DP-sharded (FSDP2) gradients summed over their
    shard group (the DP group, HSDP's shard group, or for experts the expert-data group)."""
    whole, sharded = [], []
    for p in params:
        (sharded if isinstance(p.grad, DTensor) else whole).append(p)
    total = _power_sum(whole, norm_type, device)
    for group in _shard_groups(sharded):
        parts = _power_sum([p for p in sharded if _shard_group(p.grad).group_name == group.group_name], norm_type,
                           device)
        total = total + backend.all_reduce(parts, group)
    return total


_FOREACH_DEVICES = ("cpu", "cuda")  # where torch's foreach kernels serve clip_grad_norm_


def _power_sum(params: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """sum over ``params`` of sum |g|^p, each row divided by its number of copies across the TP
    group (``_grouped_power`` per (device, dtype, copies) group)."""
    parts = []
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        replicas = getattr(p, "num_replicas", 1)
        if isinstance(replicas, torch.Tensor):  # per-row copies: its own reduction
            parts.append(_replica_weighted_power(p, norm_type).to(device))
        else:
            grad = _local(p.grad)
            groups.setdefault((grad.device, grad.dtype, replicas), []).append(grad)
    if groups:
        parts.append(_grouped_power(groups, norm_type, device))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _grouped_power(groups: dict[tuple, list[torch.Tensor]], norm_type: float, device) -> torch.Tensor:
    """sum |g|^p over ``groups`` {(device, dtype[, copies]): gradients}, each group's sum divided
    by its copies: one ``_foreach_norm`` per group, as torch's ``clip_grad_norm_`` (fp32
    accumulation), not a kernel and an fp32 copy of the gradient per parameter."""
    parts = []
    for (grad_device, _, *copies), grads in groups.items():
        power = (torch.stack(_norms(grads, norm_type)) ** norm_type).sum()
        parts.append((power if copies in ([], [1]) else power / copies[0]).to(device))
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's p-norm in fp32, with one ``_foreach_norm`` where it serves."""
    if grads[0].device.type in _FOREACH_DEVICES:
        return list(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    return [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]  # torch loops there too (XLA)


def _whole_grads(params: list[torch.Tensor], norm_type: float) -> dict[tuple, list[torch.Tensor]] | None:
    """The gradients of ``params`` by device and dtype when each counts once, as it is: at
    tp = pp = ep = 1 nothing is split over ranks, tied across stages or split into experts, so
    unless a layer replicates rows itself (``kv_size_multiplier`` K/V copies, at any tp) the p-norm
    is torch's over them (the common one-GPU case, without the rest of the sharding metadata);
    None under any model parallelism, with copied rows, FSDP2's DP-sharded gradients (DTensors),
    or for the inf-norm."""
    sizes = parallel_state.get_parallel_sizes()
    if sizes.tp > 1 or sizes.pp > 1 or sizes.ep > 1 or float(norm_type) == float("inf"):
        return None
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is not None:
            replicas = getattr(p, "num_replicas", 1)
            if isinstance(grad, DTensor) or not (isinstance(replicas, int) and replicas == 1):
                return None
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def _whole_norm(groups: dict[tuple, list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """The p-norm of ``_whole_grads``' gradients."""
    if not groups:
        return torch.zeros((), dtype=torch.float32,
                           device=backend.collective_device(parallel_state.get_model_parallel_group()))
    device = next(iter(groups))[0]
    norms = []
    for (grad_device, _), grads in groups.items():
        group_norms = _norms(grads, float(norm_type))
        norms += group_norms if grad_device == device else [n.to(device) for n in group_norms]
    return torch.linalg.vector_norm(torch.stack(norms), float(norm_type))  # as torch's get_total_norm, in fp32


def _by_device_and_dtype(grads: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def _replica_weighted_power(p: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |g|^p, each row divided by its number of copies across the TP group."""
    grad = _local(p.grad).detach().float()
    replicas = getattr(p, "num_replicas", 1)
    if isinstance(replicas, torch.Tensor):  # per row along partition_dim (fused Q + replicated K/V)
        if isinstance(p.grad, DTensor) and p.partition_dim == 0:  # FSDP2's dim-0 chunk of the rows
            mesh_dim = _shard_mesh_dim(p.grad)
            chunk = -(-p.grad.shape[0] // p.grad.device_mesh.size(mesh_dim))
            start = min(p.grad.device_mesh.get_local_rank(mesh_dim) * chunk, p.grad.shape[0])
            replicas = replicas[start:start + grad.shape[0]]
        per_row = grad.abs().pow(norm_type).movedim(p.partition_dim, 0).reshape(grad.shape[p.partition_dim], -1)
        return (per_row.sum(1) / replicas.to(per_row.device)).sum()
    return torch.linalg.vector_norm(grad, norm_type) ** norm_type / replicas


def _shard_mesh_dim(grad: DTensor) -> int:
    """The mesh dim FSDP2 shards a gradient along (under HSDP the other one replicates it)."""
    return next(i for i, placement in enumerate(grad.placements) if placement.is_shard())


def _shard_group(grad: DTensor):
    """The group over which FSDP2 splits ``grad``: its parts' ``|g|^p`` sum over it."""
    return grad.device_mesh.get_group(_shard_mesh_dim(grad))


def _shard_groups(params: list[torch.Tensor]) -> list:
    """The distinct shard groups of the DP-sharded gradients of ``params``, in first-seen order
    (the same on every rank of a group: its ranks hold the same parameters)."""
    groups = []
    for p in params:
        if isinstance(p.grad, DTensor) and _shard_group(p.grad).group_name not in {g.group_name for g in groups}:
            groups.append(_shard_group(p.grad))
    return groups


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient FSDP2 shards over the DP ranks (a DTensor); else itself."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients so the whole model's norm is at most ``max_norm``; returns the norm before
    clipping (as ``torch.nn.utils.clip_grad_norm_`` does, including its 1e-6 guard, and with
    ``error_if_nonfinite`` its RuntimeError on a nan or inf norm, before any gradient is scaled)."""
    params = _as_list(parameters)
    groups = _whole_grads(params, norm_type)  # one grouping for the norm and the scaling
    if groups is None:
        total = get_grad_norm(params, norm_type)
        groups = _by_device_and_dtype([_local(p.grad) for p in params if p.grad is not None])
    else:
        total = _whole_norm(groups, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # the same on every rank: the norm is the whole model's
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for (device, dtype), grads in groups.items():  # one kernel per group, as torch's clip_grad_norm_
        if device.type in _FOREACH_DEVICES:
            torch._foreach_mul_(grads, clip_coef.to(device, dtype))
        else:
            for g in grads:
                g.mul_(clip_coef.to(device, dtype))
    return total
