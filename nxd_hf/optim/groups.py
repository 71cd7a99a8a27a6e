"""The process groups NxD's optimizer arguments name: a group, None (parallel_state's), or
NxD's ``as_list`` form (every group's rank list)."""

from nxd_hf import backend, parallel_state


def resolve_group(spec, kind: str):
    """A process group from None (parallel_state's group of ``kind``), a group, or NxD's
    ``as_list`` form (every group's rank list; every rank must pass the same lists)."""
    getters = {
        "data": parallel_state.get_data_parallel_group, "tensor": parallel_state.get_tensor_model_parallel_group,
        "pipeline": parallel_state.get_pipeline_model_parallel_group, "model": parallel_state.get_model_parallel_group,
    }
    if spec is None:
        return getters[kind]()
    if not isinstance(spec, (list, tuple)):
        return spec
    rank_lists = [list(ranks) for ranks in spec]
    for getter in getters.values():
        if getter(as_list=True) == rank_lists:
            return getter()
    mine = [ranks for ranks in rank_lists if backend.rank() in ranks]
    if len(mine) != 1:
        raise ValueError(f"rank {backend.rank()} must be in exactly one of the groups {rank_lists}")
    created = [backend.new_group(ranks, timeout=parallel_state.get_collective_timeout(), name=f"{kind}-parallel")
               for ranks in rank_lists]  # collective: every rank creates every group
    return created[rank_lists.index(mine[0])]
