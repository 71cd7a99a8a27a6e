"""Shared checks for the layer tests: build a sharded layer and its unsharded twin from the
same seed, run both, and compare outputs, input grads and gathered parameter grads.

Layers are built as ``nn.Linear`` is (on the CPU, from the CPU generator: the same values
everywhere) and then placed, with their inputs, on the backend's compute device (``on_device``):
under ``cuda:gloo`` or nccl a collective refuses a CPU tensor."""

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor


TOL = dict(rtol=1e-4, atol=1e-5)


def tp_info():
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size()


def seq_chunk(x: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's sequence chunk of a full [b, s, ...] tensor under SP, else the tensor."""
    if not sp:
        return x
    tp_rank, tp_size = tp_info()
    s = x.shape[1] // tp_size
    return x[:, tp_rank * s : (tp_rank + 1) * s]


def assert_grads_match(param: nn.Parameter, reference_grad: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(full_tensor(param, param.grad), reference_grad, **TOL, msg=lambda m: f"{name}: {m}")


def sharded_input(x_full: torch.Tensor, sp: bool) -> torch.Tensor:
    x = seq_chunk(x_full, sp).detach().clone().requires_grad_(True)
    return x
