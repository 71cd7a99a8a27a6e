"""ZeRO-2 / ZeRO-3 over the data-parallel ranks, on torch's FSDP2 (``fully_shard``).

``parallelize(model, data_parallel_sharding="zero3")`` (or ``"zero2"``) runs the usual setup
sequence, then ``shard_data_parallel`` applies ``torch.distributed.fsdp.fully_shard`` to every
decoder layer and to the model, over a device mesh built from nxd_hf's own data-parallel group
(``DeviceMesh.from_group``): tensor-parallel shards are sharded again, along dim 0, over the DP
ranks. FSDP2's reduce-scatter then does the data-parallel mean, so the bucketed DP all-reduce of
``nxd_hf.parallel_layers.grad_reduction`` is not installed; replicated parameters whose gradient
is partial per TP rank (norms under sequence parallelism) are summed over TP per backward, before
the reduce-scatter (``partial``). Under pipeline parallelism each local stage is its own FSDP
root; under expert parallelism the experts are sharded over the expert-data group
(``experts``; the meshes, HSDP's 2-D ones included, in ``mesh``); ``data_parallel_offload``
keeps the shards in host memory (FSDP2's ``CPUOffloadPolicy``). docs/fsdp.md says what composes and what is refused.
"""

from nxd_hf.fsdp.shard import (
    DATA_PARALLEL_SHARDING, DataParallelSharding, check_data_parallel_sharding, is_dp_sharded, logical_tensor, shard_data_parallel,
)

__all__ = ["DATA_PARALLEL_SHARDING", "DataParallelSharding", "check_data_parallel_sharding", "is_dp_sharded", "logical_tensor",
           "shard_data_parallel"]
