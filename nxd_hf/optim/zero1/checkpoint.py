"""``NeuronZero1Optimizer.save_sharded_state_dict`` / ``load_sharded_state_dict`` in the
checkpoint format: the optimizer's parameters (named ``group<g>.param<i>`` by position, in
their logical layout from the sharding metadata) and their state, under ``output_dir/zero1``.
Unlike NxD's per-rank files, they load at other DP/TP sizes (same parameters and groups).
The parameters' values are stored too and loading restores them: for fp32 parameters they are
ZeRO-1's masters.
"""

from nxd_hf import parallel_state
from nxd_hf.checkpoint.load import load_checkpoint
from nxd_hf.checkpoint.logical import TensorSet, describe, describe_experts
from nxd_hf.checkpoint.save import save_checkpoint
from nxd_hf.parallel_layers.sharding import is_expert_parallel

TAG = "zero1"


def _params(optimizer) -> TensorSet:
    """The optimizer's trainable parameters, as the model ``save_checkpoint``/``load_checkpoint``
    write and read (collective over TP: every rank describes the same parameters)."""
    tp_rank, dp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_size()
    out, i = [], 0
    for g, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(p for p in group["params"] if p.requires_grad):
            name = f"group{g}.param{j}"
            if is_expert_parallel(param):  # this rank's experts, written by one rank of its expert-data group
                edp_rank = parallel_state.get_expert_data_parallel_rank()
                writes = i % parallel_state.get_expert_data_parallel_size() == edp_rank  # TP rows: describe_experts
                out.append(describe_experts(name, name, param, writes))
            else:
                out.append(describe(name, name, param, tp_rank, i % dp_size == dp_rank))
            i += 1
    return TensorSet(out)


def save_sharded(optimizer, output_dir: str, save_serially: bool = True) -> None:
    save_checkpoint(output_dir, tag=TAG, model=_params(optimizer), optimizer=optimizer,
                    num_workers=1 if save_serially else 8)


def load_sharded(optimizer, output_dir: str, num_workers_per_step: int = 8) -> None:
    if num_workers_per_step < 1:
        raise ValueError(f"num_workers_per_step must be >= 1, got {num_workers_per_step}")
    load_checkpoint(output_dir, tag=TAG, model=_params(optimizer), optimizer=optimizer,
                    num_workers=num_workers_per_step)
