"""ZeRO-1 with expert parallelism: the flat layout of ``NeuronZero1Optimizer`` split in two.

An expert-parallel parameter (``param.expert_parallel``: this rank's experts of a fused experts
tensor) is held by the ranks of its expert-data group only, whose gradients of it are summed over
that group (the all-to-all's backward already summed the tokens of the expert-parallel peers). So
its flat groups are sharded over expert_data (dp / ep ranks), the other parameters' over the data
group as without experts. The step divides both by the whole data-parallel size (the DP mean, as
``parallel_layers.grads.data_parallel_mean``). The grad norm needs nothing more: the slices'
norms summed over the data group count every expert shard once (each is split over the ranks of
one expert-data group, and those are data-parallel ranks, in the data group once each).
"""

from nxd_hf import backend, parallel_state
from nxd_hf.optim.zero1.flat import FlatGroup, build_flat_groups
from nxd_hf.parallel_layers.sharding import is_expert_parallel


def expert_sharding_group(param_groups: list[dict], sharding_group):
    """The group expert-parallel params are sharded over: the ranks holding the same experts
    (expert_data); None without expert-parallel params. Their slices' norms are summed over the
    data group with the rest's, which counts each expert shard once only when the sharding group
    is the data group."""
    if not any(is_expert_parallel(p) for group in param_groups for p in group["params"]):
        return None
    if sharding_group is not parallel_state.get_data_parallel_group():
        raise ValueError(
            "NeuronZero1Optimizer with expert-parallel parameters shards them over the expert-data group and "
            "the rest over the data-parallel group: leave sharding_groups=None (the data-parallel group)")
    return parallel_state.get_expert_data_parallel_group()


def split_flat_groups(param_groups: list[dict], *, sharding_group, expert_group, bucket_size_mb: float,
                      interleaved: bool = True) -> list[FlatGroup]:
    """The dense params' flat groups over ``sharding_group``, then the expert params' over
    ``expert_group`` (one param group's params split by ``is_expert_parallel``); ``interleaved``:
    the layout (``optim.zero1.flat``)."""
    def only(expert: bool) -> list[dict]:
        return [{**g, "params": [p for p in g["params"] if is_expert_parallel(p) == expert]} for g in param_groups]
    flat = build_flat_groups(only(False), dp_size=backend.group_size(sharding_group),
                             dp_rank=backend.group_rank(sharding_group), bucket_size_mb=bucket_size_mb,
                             interleaved=interleaved)
    if expert_group is not None:
        flat += build_flat_groups(only(True), dp_size=backend.group_size(expert_group),
                                  dp_rank=backend.group_rank(expert_group), bucket_size_mb=bucket_size_mb,
                                  interleaved=interleaved)
    return flat
