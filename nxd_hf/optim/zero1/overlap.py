"""ZeRO-1's gradient reduce-scatter overlapped with backward.

In the interleaved flat layout (``nxd_hf.optim.zero1.flat``) bucket k of a ``FlatGroup`` is one
contiguous range of parameters in backward order. A post-accumulate-grad hook on each parameter
marks it done; once every parameter of bucket k is done and the buckets before it have started,
its gradients are copied into a staging buffer and its reduce-scatter starts asynchronously
(DDP's rule: every rank starts the buckets in one order, so the collectives match). The
buckets not started when backward ends (a parameter without a gradient, one summed over TP
after backward) start then; ``step()`` waits for all (``take``).

Only inside a backward the model's gradient-reduction policy sees through its hooks (the HF
path; not the pipeline's, whose tied-weight sums come after its backwards) and outside
``no_sync()``; any later backward drops what an earlier one started, so accumulation without
``no_sync`` is still exact (the last backward's reduce-scatter counts). At most ``IN_FLIGHT``
staging buffers are in use, the first the optimizer's own (its step's all-gather uses it after
all are done), so the overlap holds one bucket more than the reduce-scatter in ``step()``;
starting another waits for the oldest.
"""

import torch

from nxd_hf import backend
from nxd_hf.optim.zero1.flat import FlatGroup
from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp, is_expert_parallel

IN_FLIGHT = 2
"""Buckets whose reduce-scatter may run at once (each holds a staging buffer of one bucket)."""


class OverlappedReduceScatter:
    """The overlapped reduce-scatter of ``optimizer`` (a ``NeuronZero1Optimizer``) into its masters' grads."""

    def __init__(self, optimizer, policies: list):
        self.optimizer, self.policies = optimizer, policies
        self.order = [(g, c0, c1) for g, fg in enumerate(optimizer.flat_groups) for c0, c1 in fg.buckets()]
        self._members = [[id(fg.params[i]) for i in fg.bucket_params(c0, c1)]
                         for fg, c0, c1 in ((optimizer.flat_groups[g], c0, c1) for g, c0, c1 in self.order)]
        self._late = [any(not _final_in_backward(optimizer.flat_groups[g].params[i])
                          for i in optimizer.flat_groups[g].bucket_params(c0, c1)) for g, c0, c1 in self.order]
        self._buckets_of: dict[int, list[int]] = {}
        for k, members in enumerate(self._members):
            for pid in members:
                self._buckets_of.setdefault(pid, []).append(k)
        self._pending: list[set[int]] = []
        self._running: list[tuple] = []
        self._free: list[torch.Tensor] = []
        self._next = 0
        self._in_backward = False
        self.active = False
        """The last backward's reduce-scatter is started (or done); ``take()`` gives its result."""
        self.started_in_backward = 0
        """Buckets of the last backward whose reduce-scatter started from a gradient hook (before its end)."""
        for fg in optimizer.flat_groups:
            for p in fg.params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin()
        if not self.active:
            return
        for k in self._buckets_of.get(id(param), ()):
            self._pending[k].discard(id(param))
        while self._next < len(self.order) and not self._pending[self._next] and not self._late[self._next]:
            self._start()
            self.started_in_backward += 1

    def _begin(self) -> None:
        """The first gradient of a backward: what an earlier backward started no longer counts."""
        self._drain()
        self._in_backward, self._next, self.started_in_backward = True, 0, 0
        self.active = (self.optimizer.overlap_reduce_scatter and self.optimizer.dp_size > 1 and bool(self.policies)
                       and all(p.in_hooked_backward() and not p.deferred for p in self.policies))
        self._pending = [set(members) for members in self._members]
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:  # queued after the policy's: gradients summed over TP are final
        self._in_backward = False
        while self.active and self._next < len(self.order):
            self._start()

    @torch.no_grad()
    def _start(self) -> None:
        g, c0, c1 = self.order[self._next]
        fg, master = self.optimizer.flat_groups[g], self.optimizer.masters[g]
        if len(self._running) >= IN_FLIGHT:
            self._wait_oldest()
        width, dtype = c1 - c0, self.optimizer.reduce_dtype(fg)
        staging = self._buffer(fg, dtype)[: fg.dp_size * width]
        lo, hi = fg.bucket_range(c0, c1)
        fg.read(lo, hi, staging, self.optimizer.grad_source)
        out = master.grad[c0:c1] if dtype == master.dtype else torch.empty(width, dtype=dtype, device=fg.device)
        with backend.comm_tag("zero1"):
            handle = backend.reduce_scatter_async(out, staging, self.optimizer.group_of(fg))
        self._running.append((handle, staging, out, master.grad[c0:c1]))
        self._next += 1

    def _buffer(self, fg: FlatGroup, dtype: torch.dtype) -> torch.Tensor:
        for i, buffer in enumerate(self._free):
            if buffer.dtype == dtype and buffer.device == fg.device:
                return self._free.pop(i)
        shared = self.optimizer._staging(dtype, fg.device)
        if all(staging.data_ptr() != shared.data_ptr() for _, staging, _, _ in self._running):
            return shared
        return torch.empty_like(shared)

    def _wait_oldest(self) -> None:
        handle, staging, out, target = self._running.pop(0)
        handle.wait()
        if out.data_ptr() != target.data_ptr():
            target.copy_(out)
        self._free.append(staging._base if staging._base is not None else staging)

    def _drain(self) -> None:
        while self._running:
            self._wait_oldest()

    def take(self) -> bool:
        """Wait for the last backward's reduce-scatter: True when the masters' grads now hold the
        DP sums (the step skips its own), False when there is none (inside ``no_sync``, another path)."""
        if not self.active or self._in_backward or self._next < len(self.order):
            self._drain()
            return False
        self._drain()
        self.active = False  # used once: a step without a new backward reduces again
        return True


def _final_in_backward(param: torch.Tensor) -> bool:
    """The gradient is final when its accumulation hook runs (not summed over TP, not another group's)."""
    return not has_partial_grad_over_tp(param) and not is_expert_parallel(param)
