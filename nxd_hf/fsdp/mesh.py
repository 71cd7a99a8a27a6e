"""FSDP2's device meshes over nxd_hf's own groups (``nxd_hf.fsdp``), never a second set of ranks.

The dense parameters shard over the data-parallel group; under expert parallelism the experts
over the expert-data group (the ranks holding the same experts, ``nxd_hf.fsdp.experts``). With
hybrid sharding (HSDP, ``data_parallel_shard_size=S``) the DP ranks in consecutive blocks of S
shard and the same position in every block replicates; the experts then shard over the
expert-data ranks inside this rank's block and replicate across the blocks. The expert-parallel
ranks are consecutive inside the DP group (DP rank d is expert block d // ep, expert rank d % ep),
so a block of S holds S / ep expert-data ranks when ep divides S, and one when S divides ep;
otherwise the blocks would cut the expert-data group unevenly (refused by
``check_data_parallel_sharding``).

Meshes over the same ranks compare equal, and DTensor caches its sharding decisions (which hold
the mesh) by them: each mesh is named after its group, so a mesh of groups re-created after
``destroy_model_parallel`` is never mistaken for the old one (whose groups are gone).
"""

import torch

from nxd_hf import backend, parallel_state


def data_parallel_mesh(shard_size: int | None = None):
    """A device mesh over the data-parallel group: 1-D, or with ``shard_size`` 2-D (replicate,
    shard) for HSDP (module docstring)."""
    dp_size = parallel_state.get_data_parallel_size()
    if shard_size is not None and (shard_size < 1 or dp_size % shard_size):
        raise ValueError(f"data_parallel_shard_size={shard_size} must divide the data-parallel size {dp_size}")
    return _mesh("dp", parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_group(as_list=True),
                 shard_size)


def expert_data_mesh(shard_size: int | None = None):
    """A device mesh over the expert-data group: 1-D, or under HSDP (``shard_size``: the DP
    shard block) 2-D, sharded over the expert-data ranks in this rank's block (module docstring)."""
    ep = parallel_state.get_expert_parallel_size()
    assert shard_size is None or not (shard_size % ep and ep % shard_size), "check_data_parallel_sharding refuses it"
    experts_shard = None if shard_size is None else max(shard_size // ep, 1)
    return _mesh("edp", parallel_state.get_expert_data_parallel_group(),
                 parallel_state.get_expert_data_parallel_group(as_list=True), experts_shard)


def _mesh(prefix: str, group, group_lists: list[list[int]], shard_size: int | None):
    from torch.distributed.device_mesh import DeviceMesh

    device_type = backend.default_device().type
    if shard_size is None or shard_size == backend.group_size(group):
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"{prefix}_{group.group_name}",))
    replicate_group, shard_group, ranks = _hybrid_groups(prefix, group_lists, shard_size)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=ranks,
                                 mesh_dim_names=(f"{prefix}_replicate_{group.group_name}",
                                                 f"{prefix}_shard_{group.group_name}"))


def _hybrid_groups(prefix: str, group_lists: list[list[int]], shard_size: int):
    """(replicate group, shard group, this rank's group as [replicas, shard_size]) from every group
    of ``group_lists``; the groups are created on every rank, in the same order, and destroyed
    with the parallel state."""
    mine = torch.distributed.get_rank()
    found = {}
    for group_ranks in group_lists:
        grid = torch.tensor(group_ranks).reshape(-1, shard_size)
        for kind, rows in (("shard", grid.tolist()), ("replicate", grid.t().tolist())):
            for ranks in rows:
                pg = backend.new_group(ranks, timeout=parallel_state.get_collective_timeout(), name=f"{prefix} {kind}")
                _HYBRID_GROUPS.append(pg)
                if mine in ranks:
                    found[kind] = pg
        if mine in group_ranks:
            found["grid"] = grid
    parallel_state.register_before_destroy(_destroy_hybrid_groups)
    return found["replicate"], found["shard"], found["grid"]


_HYBRID_GROUPS: list = []


def _destroy_hybrid_groups() -> None:
    while _HYBRID_GROUPS:
        backend.destroy_group(_HYBRID_GROUPS.pop())
