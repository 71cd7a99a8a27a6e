#  Copyright (c) Microsoft Corporation.
#  Licensed under the MIT License.
#
#  Shim for microsoft/nnscaler's tests/launch_torchrun.py (commit 1585c15): the same functions, but
#  the worker runs on nxd_hf's pool of gloo ranks (nxd_hf.testing.pool, set by conftest.py) instead
#  of a torchrun elastic launch per call, and without the CUDA check (CPU ranks).
"""``launch_torchrun(n, fn, *args)`` / ``torchrun(n, fn, *args)`` for nnScaler's tests on gloo ranks."""

from typing import Callable

import torch

POOLS = None  # the session's nxd_hf.testing.pool.RankPools, set by conftest.py


def launch_torchrun(nproc_per_node, worker_fn, *args, **kwargs):
    """``{rank: worker_fn(*args, **kwargs)}``, as torch's elastic launch returns it."""
    assert POOLS is not None, "run under pytest: tests/conformance/nnscaler/conftest.py sets the rank pool"
    outputs = POOLS.get(nproc_per_node).run(worker_fn, *args, **kwargs)
    return dict(enumerate(outputs))


def torchrun(nproc_per_node: int, test_fn: Callable, *args, **kwargs):
    launch_torchrun(nproc_per_node, test_fn, *args, **kwargs)


def clone_to_cpu(tensor: torch.Tensor):
    cloned_tensor = tensor.cpu().clone().detach().requires_grad_(tensor.requires_grad)
    if tensor.is_leaf and tensor.grad is not None:
        cloned_tensor.grad = tensor.grad.cpu().clone()
    return cloned_tensor


def clone_to_cpu_recursively(data):
    if isinstance(data, torch.Tensor):
        return clone_to_cpu(data)
    elif isinstance(data, dict):
        return {k: clone_to_cpu_recursively(v) for k, v in data.items()}
    elif isinstance(data, list):
        return [clone_to_cpu_recursively(v) for v in data]
    elif isinstance(data, tuple):
        return tuple(clone_to_cpu_recursively(v) for v in data)
    else:
        return data
