"""``_non_parallel_module_reducer``: gradients of the parameters outside every ``ParallelModule``.

Under submodule parallelization (nnScaler's Example 2) the rest of the model is replicated on
every rank: inside a unit its ranks see the same input and compute the same gradients; across
units they differ (data parallelism). ``sync_grads`` averages them over the data-parallel group
of ``parallel_state`` (one rank per unit at each tensor/pipeline position), so every rank ends
with the mean over the units. The ``ParallelModule``s reduce their own gradients at the end of
backward (``nxd_hf.parallel_layers.grad_reduction``); ``build_optimizer`` calls ``sync_grads``
before the optimizer steps (``optimizer._non_parallel_module_reducer``).
"""

from collections.abc import Callable

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler.module import ParallelModule
from nxd_hf.parallel_layers.grads import accumulated_grad, all_reduce_bucketed

Hook = Callable[["NonParallelReducer", torch.Tensor], None]


def non_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of ``model`` that no ``ParallelModule`` inside it holds."""
    parallel = {id(p) for m in model.modules() if isinstance(m, ParallelModule) for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in parallel]


class NonParallelReducer:
    """Averages the gradients of ``params`` over the units (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], *, bucket_size_mb: float = 25):
        self.params = list(params)
        self.bucket_size_mb = bucket_size_mb
        self._pre_hooks: list[Hook] = []
        self._post_hooks: list[Hook] = []

    def register_pre_hook(self, fn: Hook) -> None:
        """``fn(reducer, grad)`` on each gradient before the reduction (nnScaler's reducer hook)."""
        self._pre_hooks.append(fn)

    def register_post_hook(self, fn: Hook) -> None:
        """``fn(reducer, grad)`` on each gradient after the reduction."""
        self._post_hooks.append(fn)

    def sync_grads(self) -> None:
        grads = [g for g in (accumulated_grad(p) for p in self.params) if g is not None]
        for fn in self._pre_hooks:
            for g in grads:
                fn(self, g)
        if parallel_state.model_parallel_is_initialized():
            group, size = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_size()
        else:
            group, size = None, backend.world_size()
        if size > 1:
            all_reduce_bucketed(grads, group, scale=1.0 / size, bucket_size_mb=self.bucket_size_mb)
        for fn in self._post_hooks:
            for g in grads:
                fn(self, g)


def non_parallel_module_reducer(model: nn.Module, compute_config=None) -> NonParallelReducer | None:
    """The reducer of ``model``'s non-parallel parameters (None when every parameter is in a
    ``ParallelModule``); ``compute_config`` sets the bucket size."""
    params = non_parallel_parameters(model)
    if not params:
        return None
    bucket = getattr(compute_config, "reducer_bucket_cap_mb", None) or 25
    return NonParallelReducer(params, bucket_size_mb=bucket)
