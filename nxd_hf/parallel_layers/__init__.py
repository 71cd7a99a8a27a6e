"""Sharded layers, their collectives, gradient sync and clipping (NxD's ``parallel_layers``)."""

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.parallel_layers.utils import move_model_to_device

__all__ = [
    "ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "move_model_to_device", "parallel_state",
]
