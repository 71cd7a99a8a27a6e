"""nnScaler's reducers: the gradient synchronization of a set of parameters over a group, with
pre/post hooks ``fn(reducer, grad)``; and ``_non_parallel_module_reducer``'s parameters.

Under submodule parallelization (nnScaler's Example 2) the rest of the model is replicated on
every rank: inside a unit its ranks see the same input and compute the same gradients; across
units they differ (data parallelism). Its reducer averages them over the data-parallel group of
``parallel_state`` (one rank per unit at each tensor/pipeline position), so every rank ends with
the mean over the units. The parallel parts (anything with ``model.nxd``: a ``ParallelModule`` or
an HF model from ``nxd_hf.parallelize``) reduce their own gradients; ``build_optimizer`` runs
every reducer before the optimizer steps (``optimizer._non_parallel_module_reducer``).
"""

from collections.abc import Callable

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler.state_layout import parallel_parts
from nxd_hf.parallel_layers.grads import accumulated_grad, all_reduce_bucketed

Hook = Callable[["Reducer", torch.Tensor], None]


class Reducer:
    """The gradient synchronization of ``params`` over ``group`` (nnScaler's reducer). Pre hooks
    ``fn(reducer, grad)`` see each local gradient before it, post hooks each reduced gradient
    after it. ``reduce(grads) -> reduced grads``: default the mean over ``group`` in place."""

    def __init__(self, params: list[torch.Tensor], group, *, grad_of=None, reduce=None, bucket_size_mb: float = 25):
        self.params, self.group, self.bucket_size_mb = list(params), group, bucket_size_mb
        self._grad_of = grad_of or accumulated_grad
        self._reduce = reduce or self._mean
        self.pre_hooks: list[Hook] = []
        self.post_hooks: list[Hook] = []

    def register_pre_hook(self, fn: Hook) -> None:
        self.pre_hooks.append(fn)

    def register_post_hook(self, fn: Hook) -> None:
        self.post_hooks.append(fn)

    def parameters_for_optimizer(self) -> list[torch.Tensor]:
        return list(self.params)

    def sync_grads(self) -> None:
        grads = [g for g in map(self._grad_of, self.params) if g is not None]
        for hook in self.pre_hooks:
            for grad in grads:
                hook(self, grad)
        reduced = self._reduce(grads)
        for hook in self.post_hooks:
            for grad in reduced:
                hook(self, grad)

    def _mean(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        size = backend.group_size(self.group)
        if size > 1:
            all_reduce_bucketed(grads, self.group, scale=1.0 / size, bucket_size_mb=self.bucket_size_mb)
        return grads


def non_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``model`` that no parallel part inside it holds."""
    parallel = {id(p) for _, part in parallel_parts(model) for p in part.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in parallel]


def non_parallel_module_reducer(model: nn.Module, compute_config=None) -> Reducer | None:
    """The reducer of ``model``'s non-parallel parameters over the units (None when every
    parameter is in a parallel part); ``compute_config`` sets the bucket size."""
    params = non_parallel_parameters(model)
    if not params:
        return None
    group = parallel_state.get_data_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    bucket = getattr(compute_config, "reducer_bucket_cap_mb", None) or 25
    return Reducer(params, group, bucket_size_mb=bucket)
