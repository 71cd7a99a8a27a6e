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
from nxd_hf.parallel_layers.grads import accumulated_grad

Hook = Callable[["Reducer", torch.Tensor], None]


class Reducer:
    """The gradient synchronization of ``params`` over ``group`` (nnScaler's reducer). By default
    the mean over ``group``, as nnScaler's: one flat buffer per bucket of ``bucket_size_mb``; each
    pre hook ``fn(reducer, grad)`` is called once per bucket with that buffer before the all-reduce
    (changing it changes what is reduced), each post hook once per bucket after it, and the
    buffer is then copied into the gradients. With ``reduce(grads) -> reduced grads`` (ZeRO-1's
    reduce-scatter) the pre hooks see each local gradient and the post hooks each reduced slice."""

    def __init__(self, params: list[torch.Tensor], group, *, grad_of=None, reduce=None, bucket_size_mb: float = 25):
        self.params, self.group, self.bucket_size_mb = list(params), group, bucket_size_mb
        self._grad_of = grad_of or accumulated_grad
        self._reduce = reduce
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
        if self._reduce is not None:
            for hook in self.pre_hooks:
                for grad in grads:
                    hook(self, grad)
            reduced = self._reduce(grads)
            for hook in self.post_hooks:
                for grad in reduced:
                    hook(self, grad)
            return
        size = backend.group_size(self.group)
        if size == 1 and not self.pre_hooks and not self.post_hooks:
            return
        for bucket in _buckets(grads, self.bucket_size_mb):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            for hook in self.pre_hooks:
                hook(self, flat)
            if size > 1:
                backend.all_reduce(flat, self.group)
                flat.mul_(1.0 / size)
            for hook in self.post_hooks:
                hook(self, flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _buckets(grads: list[torch.Tensor], bucket_size_mb: float) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, about ``bucket_size_mb`` each (at least one)."""
    limit, out, size = bucket_size_mb * 2**20, [], 0.0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > limit or (out[-1][0].dtype, out[-1][0].device) != (g.dtype, g.device):
            out.append([])
            size = 0.0
        out[-1].append(g)
        size += nbytes
    return out


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
