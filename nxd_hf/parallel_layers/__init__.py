"""Sharded layers, their collectives, gradient sync and clipping (NxD's ``parallel_layers``)."""

from nxd_hf import parallel_state
from nxd_hf.parallel_layers import random
from nxd_hf.parallel_layers.checkpointing import load, save
from nxd_hf.parallel_layers.grads import (
    allreduce_sequence_parallel_gradients, clip_grad_norm, get_grad_norm, sync_data_parallel_grads,
)
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy
from nxd_hf.parallel_layers.pad import get_number_of_extra_heads, pad_model
from nxd_hf.parallel_layers.sharding import move_model_to_device
from nxd_hf.parallel_layers.grad_scaler import install as _agree_grad_scaler_skips
from nxd_hf.parallel_layers.torch_clip import install as _route_torch_clip_grad_norm

_route_torch_clip_grad_norm()  # torch.nn.utils.clip_grad_norm_ on a parallel model: the whole model's norm
_agree_grad_scaler_skips()  # torch's GradScaler on a parallel model: a step skipped on every rank or none

__all__ = [
    "ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "allreduce_sequence_parallel_gradients",
    "clip_grad_norm", "get_grad_norm", "get_number_of_extra_heads", "load", "move_model_to_device", "pad_model",
    "parallel_cross_entropy", "parallel_state", "random", "save", "sync_data_parallel_grads",
]
