"""Gradient synchronization installed by ``parallelize``: once per backward, at its end.

- Parameters marked ``sequence_parallel_enabled`` (replicated, partial gradient per TP rank)
  get this backward's contribution summed over TP, bucketed. Only the new contribution is
  summed, so gradient accumulation over several backwards stays correct.
- Every gradient is averaged over the data-parallel group (bucketed), unless inside
  ``model.no_sync()`` (accumulation micro-steps) or when the DP size is 1.
"""

import contextlib

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.optim.mixed_precision import accumulated_grad
from nxd_hf.parallel_layers.grads import all_reduce_bucketed, sync_data_parallel_grads


class GradSync:
    """The hooks and state of one model's post-backward synchronization."""

    def __init__(self, model: nn.Module, *, bucket_size_mb: float = 25):
        self.model = model
        self.params, self.partial = [], []
        self.bucket_size_mb = bucket_size_mb
        self.sync_dp = True
        self._in_backward = False
        self.paused = False
        self._before = []

    def refresh(self, *_) -> None:
        """(Re-)attach the gradient hooks when the parameters changed (loading replaces the
        meta parameters), so the hooks always sit on the parameters being trained."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if [id(p) for p in params] == [id(p) for p in self.params]:
            return
        self.params = params
        self.partial = [p for p in params if getattr(p, "sequence_parallel_enabled", False)]
        for p in params:
            p.register_hook(self._on_grad)

    def begin(self, params: list[torch.Tensor]) -> list:
        """Pause the per-backward hooks (a pipeline step runs many backwards) and snapshot the
        partial grads of ``params``; ``finish_partial`` sums their new contribution over TP."""
        self.paused = True
        partial = [p for p in params if getattr(p, "sequence_parallel_enabled", False)]
        return _snapshot(partial)

    def finish_partial(self, snapshot: list) -> None:
        self.paused = False
        self._sum_partial_deltas(snapshot)

    def _sum_partial_deltas(self, snapshot: list) -> None:
        fresh = [(accumulated_grad(p), before) for p, before in snapshot if accumulated_grad(p) is not None]
        deltas = [grad.detach() - (0 if before is None else before) for grad, before in fresh]
        all_reduce_bucketed(deltas, parallel_state.get_tensor_model_parallel_group(), bucket_size_mb=self.bucket_size_mb)
        for (grad, before), delta in zip(fresh, deltas):
            grad.detach().copy_(delta if before is None else before + delta)

    def _on_grad(self, grad):
        if not self._in_backward and not self.paused:  # first gradient of this backward
            self._in_backward = True
            self._before = _snapshot(self.partial)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return grad

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._sum_partial_deltas(self._before)
        self._before = []
        if self.sync_dp and parallel_state.get_data_parallel_size() > 1:
            sync_data_parallel_grads(self.params, bucket_size_mb=self.bucket_size_mb)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the data-parallel average for backwards inside the block (accumulation)."""
        previous, self.sync_dp = self.sync_dp, False
        try:
            yield
        finally:
            self.sync_dp = previous


def _snapshot(params: list[torch.Tensor]) -> list:
    """(param, copy of its accumulated gradient or None) before a backward adds to it."""
    result = []
    for p in params:
        grad = accumulated_grad(p)
        result.append((p, None if grad is None else grad.detach().clone()))
    return result


def install_grad_sync(model: nn.Module, *, bucket_size_mb: float = 25) -> GradSync:
    """Attach a ``GradSync`` to ``model`` and expose ``model.no_sync()`` as in DDP."""
    sync = GradSync(model, bucket_size_mb=bucket_size_mb)
    model.register_forward_pre_hook(sync.refresh)
    model._nxd_grad_sync = sync
    model.no_sync = sync.no_sync
    return sync
