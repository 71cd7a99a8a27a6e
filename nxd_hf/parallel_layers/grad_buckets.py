"""Gradients in flat buckets, allocated once, averaged over data parallel during backward.

Each eligible parameter's gradient lives in a view of one flat buffer per bucket (about
``bucket_size_mb`` each; one dtype and device; parameters in reverse order, about the order
backward produces their gradients). When autograd has accumulated a parameter's gradient, a
hook copies it into its view and points ``param.grad`` at the view (only when ``param.grad``
is not the view already: after ``zero_grad(set_to_none=True)`` autograd hands over a fresh
tensor, which is then freed). So gradients stop wandering through the heap step after step,
and the buffer is the all-reduce's input and output (no concatenation, no copy back). A bucket's buffer is allocated when backward produces its first
gradient and dropped at the next forward if every gradient in it was set to None
(``zero_grad(set_to_none=True)``), so the gradients take no memory while the activations do,
as with autograd's own tensors.

Overlap (DDP's rule): once every parameter of bucket k has its gradient and buckets 0..k-1
have started, bucket k's all-reduce starts asynchronously; every rank starts the buckets in
index order, so the collectives match. ``finish()`` starts the rest, waits for all, and scales
by 1/dp. A parameter without a gradient in this backward contributes zeros and keeps
``grad=None``. With ``overlap=False`` every bucket starts in ``finish()`` (the same sums, in
the same buffers: bitwise the same result).
"""

import dataclasses

import torch

from nxd_hf import backend
from nxd_hf.utils.host_memory import release_free_host_memory


@dataclasses.dataclass(kw_only=True)
class Bucket:
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None
    """The gradients of ``params``, back to back (None until a backward needs it)."""
    views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    pending: set[int] = dataclasses.field(default_factory=set)
    """ids of the parameters whose gradient this backward has not produced yet."""


class GradBuckets:
    """The buckets of ``params`` (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], *, bucket_size_mb: float, overlap: bool = True):
        self.overlap = overlap
        self.buckets = [Bucket(params=group) for group in _groups(list(reversed(params)), bucket_size_mb)]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._group, self._handles, self._next = None, [], 0
        self.started_in_backward = 0
        """Buckets whose all-reduce started before ``finish()`` in the last backward."""

    def params(self) -> list[torch.Tensor]:
        return [p for b in self.buckets for p in b.params]

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._where

    def hook(self, param: torch.Tensor) -> None:
        """Register the post-accumulation hook on ``param`` (one of the bucketed parameters)."""
        param.register_post_accumulate_grad_hook(self._accumulated)

    def release_unused(self) -> None:
        """Drop the buffers whose gradients were all set to None (before a forward)."""
        for bucket in self.buckets:
            if bucket.flat is not None and all(p.grad is None for p in bucket.params):
                bucket.flat, bucket.views = None, []

    def begin(self, group) -> None:
        """A backward starts; its buckets are all-reduced over ``group`` (None: not reduced)."""
        self._group, self._handles, self._next, self.started_in_backward = group, [], 0, 0
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}

    @torch.no_grad()
    def _accumulated(self, param: torch.Tensor) -> None:
        bucket, index = self._where[id(param)]
        if bucket.flat is None and len(bucket.params) == 1 and param.grad.is_contiguous():
            bucket.flat, bucket.views = param.grad.view(-1), [param.grad]  # a bucket of one adopts autograd's tensor
        _into_view(param, _allocated(bucket).views[index])
        bucket.pending.discard(id(param))
        if self.overlap and self._group is not None:
            while self._next < len(self.buckets) and not self.buckets[self._next].pending:
                self._start(self._next)
                self.started_in_backward += 1

    def _start(self, index: int) -> None:
        self._handles.append(backend.all_reduce_async(self.buckets[index].flat, self._group))
        self._next = index + 1

    @torch.no_grad()
    def finish(self, scale: float) -> None:
        """Start the buckets not started yet, wait for all, multiply by ``scale`` (after ``begin``
        with a group); without a group only gradients set outside backward are moved in."""
        for bucket in self.buckets[self._next:]:
            if bucket.flat is None and (self._group is None or all(p.grad is None for p in bucket.params)):
                if self._group is not None:  # this rank's share of a collective every rank starts
                    _allocated(bucket).flat.zero_()
                continue
            for param, view in zip(bucket.params, _allocated(bucket).views):
                if param.grad is None:
                    view.zero_()
                else:
                    _into_view(param, view)
        if self._group is None:
            return
        for index in range(self._next, len(self.buckets)):
            self._start(index)
        for handle in self._handles:
            handle.wait()
        for bucket in self.buckets:
            if scale != 1.0:
                bucket.flat.mul_(scale)
        for bucket in self.buckets:  # none of its gradients is wanted: no memory held for it
            if all(p.grad is None for p in bucket.params):
                bucket.flat, bucket.views = None, []
        self._group, self._handles = None, []


def _into_view(param: torch.Tensor, view: torch.Tensor) -> None:
    if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad)
        param.grad = view


def _groups(params: list[torch.Tensor], bucket_size_mb: float) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, each group under the size (or one parameter)."""
    limit, groups = bucket_size_mb * 2**20, []
    for p in params:
        size = p.numel() * p.element_size()
        last = groups[-1] if groups else None
        if (last is None or (p.dtype, p.device) != (last[0].dtype, last[0].device)
                or sum(q.numel() * q.element_size() for q in last) + size > limit):
            groups.append([p])
        else:
            last.append(p)
    return groups


def _allocated(bucket: Bucket) -> Bucket:
    """``bucket`` with its buffer (uninitialized: every view is written before it is read)."""
    if bucket.flat is None:
        if bucket.params[0].device.type == "cpu":  # the activations backward freed so far: their pages go back first
            release_free_host_memory()
        params = bucket.params
        bucket.flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        bucket.views = [bucket.flat[a:b].view_as(p) for p, a, b in zip(params, offsets, offsets[1:])]
    return bucket
