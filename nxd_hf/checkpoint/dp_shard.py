"""The ``LogicalTensor`` of a parameter that FSDP2 shards over the data-parallel ranks (ZeRO-2/3,
``nxd_hf.fsdp``): a DTensor whose local tensor holds rows ``[start, start + n)`` along dim 0 of
its TP-local tensor (FSDP2 chunks dim 0 as ``torch.chunk`` does: ``ceil(n0 / dp)`` rows a rank).

Every DP rank writes its own rows (not a turn per tensor as replicas do), so the checkpoint is
the same logical safetensors a DDP or ZeRO-1 job writes and loads at any layout:

- replicated over TP: its DP rows along dim 0, written by TP rank 0;
- TP-sharded along dim 0: the DP rows are a run of the TP shard's rows (``shard_index``);
- TP-sharded along another dim: a box, the DP rows along dim 0 x the TP rows along ``partition_dim``;
- an HF ``Conv1D`` weight (GPT-2), stored transposed: the same, along the swapped dims;
- an expert-parallel tensor (fused experts), sharded over the expert-data group instead: its
  rows along dim 0 are experts (``expert_shard_index``), the expert-data rank's run of them.

The local tensor (``DTensor._local_tensor``, one object for the life of the shard) stands for
the parameter: optimizer state is keyed by it (``optim_state``) and loading copies into it.
"""

import torch
from torch.distributed.tensor import DTensor

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import is_sharded


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DP-sharded DTensor (the tensor itself otherwise)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def as_dp_shard(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Optimizer state ``value`` read for ``param``: a DTensor laid out as ``param`` when that is one
    and ``value`` is this rank's local part of a per-element state (a scalar such as ``step`` stays)."""
    if not isinstance(param, DTensor) or value.shape != local_of(param).shape or value.dim() == 0:
        return value
    return DTensor.from_local(value.to(local_of(param).device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def dp_rows(param: DTensor) -> tuple[int, int, bool]:
    """(start, number) of the rows along dim 0 of the TP-local tensor this DP rank holds, and
    whether it is the first of its copies (HSDP replicates each shard across groups of DP ranks)."""
    mesh_dim = next(i for i, placement in enumerate(param.placements) if placement.is_shard())
    mesh = param.device_mesh
    rows = param.shape[0]
    chunk = -(-rows // mesh.size(mesh_dim))
    start = min(mesh.get_local_rank(mesh_dim) * chunk, rows)
    first_copy = all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim) if d != mesh_dim)
    return start, local_of(param).shape[0], first_copy


def describe_dp_shard(name: str, model_name: str, param: DTensor, tp_rank: int, owned_runs) -> dict:
    """The fields of ``param``'s ``LogicalTensor`` (see the module docstring); ``owned_runs(rows,
    tp_rank)`` is ``logical._owned_runs`` (collective over TP: every TP rank holds the same DP rows).
    An HF ``Conv1D`` weight (GPT-2, stored ``[in, out]``) is described as its transpose: the same
    rows and runs, along the swapped dims of the on-disk orientation."""
    fields = _describe_untransposed(name, model_name, param, tp_rank, owned_runs)
    if not getattr(param, "hf_transposed", False):
        return fields
    assert param.dim() == 2, "HF Conv1D weights are 2-D"
    fields.update(transposed=True, shape=fields["shape"][::-1], dim=1 - fields["dim"])
    if "inner_dim" in fields:
        fields["inner_dim"] = 1 - fields["inner_dim"]
    return fields


def _describe_untransposed(name: str, model_name: str, param: DTensor, tp_rank: int, owned_runs) -> dict:
    """``describe_dp_shard`` in the TP-local tensor's orientation."""
    local = local_of(param)
    start, count, first_copy = dp_rows(param)
    # an HSDP copy of the shard (first_copy False) writes nothing: the first copy writes it
    shape = list(param.shape)
    rows = torch.arange(start, start + count)
    dp_first = parallel_state.get_data_parallel_rank() == 0
    common = dict(name=name, tensor=local, transposed=False, model_name=model_name, dim=0,
                  writes_whole=dp_first and tp_rank == 0)
    if not is_sharded(param):
        return dict(**common, shape=tuple(shape), rows=rows,
                             runs=[(0, count, start)] if count and tp_rank == 0 and first_copy else [])
    dim, shard_index = param.partition_dim, param.shard_index
    shape[dim] = param.logical_size
    tp_runs = owned_runs(shard_index, tp_rank)
    if dim == 0:  # the TP shard's runs, cut to this DP rank's rows
        runs = [(max(a, start) - start, min(b, start + count) - start, first + max(a, start) - a)
                for a, b, first in tp_runs if max(a, start) < min(b, start + count) and first_copy]
        return dict(**common, shape=tuple(shape), rows=shard_index[start:start + count], runs=runs)
    return dict(**common, shape=tuple(shape), rows=rows,
                         runs=[(0, count, start)] if count and tp_runs and first_copy else [],
                         inner_dim=dim, inner_rows=shard_index, inner_runs=tp_runs)


def describe_dp_experts(name: str, model_name: str, param: DTensor, tp_rank: int, owned_runs) -> dict:
    """The fields of the ``LogicalTensor`` of a fused experts tensor FSDP2 shards over the
    expert-data group (``nxd_hf.fsdp.experts``): this rank's run of its expert-parallel rank's
    experts along dim 0, a box when TP also shards each expert's rows (``logical.describe_experts``)."""
    assert not getattr(param, "hf_transposed", False), "fused experts are not HF Conv1D weights"
    start, count, first_copy = dp_rows(param)
    rows = param.expert_shard_index[start:start + count]
    shape = [param.expert_logical_size, *param.shape[1:]]
    mesh = param.device_mesh  # the expert-data group's first rank: every coordinate 0 (HSDP's mesh is 2-D)
    edp_first = all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim))
    inner, writes_rows = {}, count > 0 and first_copy and tp_rank == 0
    if is_sharded(param):
        assert param.partition_dim != 0, "TP shards the expert rows, not the experts"
        shape[param.partition_dim] = param.logical_size
        inner_runs = owned_runs(param.shard_index, tp_rank)  # collective over TP: every rank joins
        inner = dict(inner_dim=param.partition_dim, inner_rows=param.shard_index, inner_runs=inner_runs)
        writes_rows = count > 0 and first_copy and bool(inner_runs)
    return dict(name=name, model_name=model_name, tensor=local_of(param), shape=tuple(shape), dim=0, rows=rows,
                transposed=False, runs=[(0, count, int(rows[0]))] if writes_rows else [],
                writes_whole=edp_first and tp_rank == 0 and parallel_state.get_expert_parallel_rank() == 0, **inner)
