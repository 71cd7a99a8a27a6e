"""ZeRO-1 optimizer shards on disk: one ``torch.save`` file per rank.

A rank's file is named by its (dp, tp, pp) coordinates, written under a temporary name and
renamed, so a crash never leaves a truncated file under the final name. Saving can go one DP
rank at a time and loading a bounded number of ranks at a time, to bound host memory and I/O.
"""

import os

import torch

from nxd_hf import backend, parallel_state


def shard_path(output_dir: str, dp_rank: int) -> str:
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(output_dir, f"zero1_dp_rank_{dp_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt")


def save_zero1_shard(state_dict: dict, output_dir: str, *, group, dp_rank: int, dp_size: int, save_serially: bool) -> None:
    """Write this rank's ``state_dict``; with ``save_serially`` the DP ranks of ``group`` take
    turns (a barrier after each)."""
    os.makedirs(output_dir, exist_ok=True)
    path = shard_path(output_dir, dp_rank)
    for turn in range(dp_size if save_serially else 1):
        if not save_serially or turn == dp_rank:
            tmp = f"{path}.tmp.{os.getpid()}"
            torch.save(state_dict, tmp)
            os.replace(tmp, path)
        if save_serially:
            backend.barrier(group)
    backend.barrier()  # every file exists when any rank returns


def load_zero1_shard(output_dir: str, *, dp_rank: int, device, num_workers_per_step: int) -> dict:
    """Read this rank's shard, at most ``num_workers_per_step`` ranks reading at a time."""
    if num_workers_per_step < 1:
        raise ValueError(f"num_workers_per_step must be >= 1, got {num_workers_per_step}")
    path = shard_path(output_dir, dp_rank)
    if not os.path.exists(path):
        raise ValueError(f"no ZeRO-1 optimizer shard for this rank at {path}: was it saved with save_sharded_state_dict "
                         "at the same data/tensor/pipeline parallel sizes?")
    state_dict = None
    world, rank = backend.world_size(), backend.rank()
    for turn in range(-(-world // num_workers_per_step)):
        if rank // num_workers_per_step == turn:
            state_dict = torch.load(path, map_location=device, weights_only=True)
        backend.barrier()
    return state_dict
