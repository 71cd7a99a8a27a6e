"""One model's gradient-reduction policy, shared by the HF forward/backward path, the pipeline
step and the optimizers.

After a backward (a pipeline step counts as one), this model's gradients get, in this order:

1. the model's own extra reductions (``add_reduction``: tied weights held by stages on
   different pipeline ranks are summed over their group);
2. partial gradients summed over TP: replicated parameters marked ``partial_grad_over_tp``
   (``sharding.mark_partial_grad_over_tp``; NxD's ``sequence_parallel_enabled`` is its alias)
   see only this rank's part of the data (norms under sequence parallelism, per-head norms).
   Only this backward's contribution is summed, so accumulation stays correct;
3. the data-parallel mean, done by exactly one party:
   - the backward itself, the default: on the HF path (``install_hooks``) gradients live in
     flat buckets allocated once (``grad_buckets``), each all-reduced asynchronously as soon as
     backward has produced all of its gradients (``overlap=False``: all at the end), waited
     for at the end of the backward; parameters outside the buckets (fp32 ``main_grad``,
     partial over TP, expert-parallel) and the pipeline path: a bucketed all-reduce at the end;
   - nobody, inside ``no_sync()`` (accumulation micro-steps: the first backward outside it
     averages the accumulated sum);
   - an optimizer that reduces in its ``step()`` and registered itself with
     ``reduce_in_optimizer`` (ZeRO-1's reduce-scatter, the config API's optimizer).
   Expert-parallel parameters are averaged over the expert-data group instead (``grads.data_parallel_mean``);
   one that got no tokens on this rank gets a zero gradient first (its peers' reduction needs it).

Gradients are read where they accumulate (``accumulated_grad``: fp32 ``main_grad`` or ``grad``).
"""

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.grad_buckets import GradBuckets
from nxd_hf.parallel_layers.grads import accumulated_grad, all_reduce_bucketed, data_parallel_mean
from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp, is_expert_parallel
from nxd_hf.utils.host_memory import release_free_host_memory

_LIVE: "weakref.WeakSet[GradReduction]" = weakref.WeakSet()


class GradReduction:
    """The policy above for the trainable parameters of ``roots`` (this rank's modules)."""

    def __init__(self, roots: list[nn.Module], *, bucket_size_mb: float = 25, dp_in_optimizer: bool = False):
        self.roots = roots
        self.bucket_size_mb = bucket_size_mb
        self.dp_in_optimizer = dp_in_optimizer
        self.deferred = False
        self._extra: list[Callable[[], None]] = []
        self._hooked: list[int] = []
        self._snapshot: list | None = None
        self._trained: list[torch.Tensor] = []
        """The trainable parameters as the last forward found them (one walk of the modules a step)."""
        self.release_host_memory = backend.default_device().type == "cpu"
        """Return freed heap pages to the OS (``utils.host_memory``) at the start and end of each forward and
        before its output head, at the first gradient, before each gradient bucket is allocated and at the end
        of each backward; only where the model computes on the CPU (an accelerator's activations are not on the
        C heap)."""
        self.overlap = True
        """Start each bucket's data-parallel all-reduce during backward (False: at its end)."""
        self.sum_partial_after_backward = True
        """Sum the gradients partial over TP after each backward (False: something sums them during
        it, as FSDP2's hooks on its unsharded parameters, ``nxd_hf.fsdp``)."""
        self.buckets: GradBuckets | None = None
        """The gradient buckets of the HF path (None on the pipeline path and in a world of one)."""
        self._grad_bytes = 0
        _LIVE.add(self)

    def params(self) -> list[torch.Tensor]:
        seen, params = set(), []
        for root in self.roots:
            for p in root.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def add_reduction(self, reduce: Callable[[], None]) -> None:
        """Run ``reduce()`` first after every backward (step 1 of the module docstring)."""
        self._extra.append(reduce)

    def reduce_in_optimizer(self) -> None:
        """An optimizer whose ``step()`` does the data-parallel reduction takes it over."""
        self.dp_in_optimizer = True

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the data-parallel mean for backwards inside the block (accumulation), as DDP."""
        previous, self.deferred = self.deferred, True
        try:
            yield
        finally:
            self.deferred = previous

    # -- the HF path: hooks find the end of each backward
    def install_hooks(self, model: nn.Module) -> None:
        """Reduce at the end of every backward through ``model``'s forward."""
        model.register_forward_pre_hook(self._refresh_hooks)
        model.register_forward_hook(self._after_forward)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, nn.Module):  # the layers' freed temporaries, before the logits and the loss: the peak
            head.register_forward_pre_hook(self._after_forward)

    def _after_forward(self, *_) -> None:
        if self.release_host_memory and torch.is_grad_enabled():  # the forward's freed temporaries, before backward
            release_free_host_memory()

    def _backward_has_work(self) -> bool:
        """Whether the end of a backward has anything to do: at tp = dp = 1 (one GPU) without extra
        reductions or heap trims nothing is partial or averaged, so no gradient hook runs and the
        parameters are not walked each step (as plain HF). Asked every forward: an extra reduction
        added later turns the hooks on."""
        return bool(self._extra) or self.release_host_memory or self.buckets is not None or (
            parallel_state.get_tensor_model_parallel_size() > 1 or parallel_state.get_data_parallel_size() > 1)

    def _refresh_hooks(self, *_) -> None:
        """(Re-)attach gradient hooks when the parameters changed (e.g. replaced by loading)."""
        if not self._backward_has_work():
            return
        if torch.is_grad_enabled() and self.buckets is not None:
            self.buckets.release_unused()
        if self.release_host_memory and torch.is_grad_enabled():  # freed gradients' pages, before activations
            release_free_host_memory()
        params = self._trained = self.params()  # this step's list: the backward's hooks reuse it
        if [id(p) for p in params] == self._hooked:
            return
        self._hooked = [id(p) for p in params]
        for p in params:
            p.register_hook(self._on_grad)
        if parallel_state.get_data_parallel_size() == 1:  # no DP reduction: autograd's own tensors, no copy
            return
        self.buckets = GradBuckets([p for p in params if _bucketable(p)], bucket_size_mb=self.bucket_size_mb,
                                   overlap=self.overlap)
        for p in self.buckets.params():
            self.buckets.hook(p)

    def _reduces_dp(self) -> bool:
        return not self.deferred and not self.dp_in_optimizer and parallel_state.get_data_parallel_size() > 1

    def _on_grad(self, grad):
        if self._snapshot is None:  # the first gradient of this backward
            if self.release_host_memory:  # the forward's freed temporaries
                release_free_host_memory()
            if self.buckets is not None:
                self.buckets.overlap = self.overlap
                self.buckets.begin(parallel_state.get_data_parallel_group() if self._reduces_dp() else None)
            self._snapshot = _snapshot(self._trained)
            self._grad_bytes = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_hooked_backward)
        elif self.buckets is None and self.release_host_memory:  # no buckets: trim as often as they would
            self._grad_bytes += grad.numel() * grad.element_size()
            if self._grad_bytes > self.bucket_size_mb * 2**20:
                self._grad_bytes = 0
                release_free_host_memory()
        return grad

    def in_hooked_backward(self) -> bool:
        """Whether a backward seen by this policy's gradient hooks (the HF path) is running now:
        its reductions end it (an optimizer's own overlapped reduction may start inside it)."""
        return self._snapshot is not None

    def _end_of_hooked_backward(self) -> None:
        snapshot, self._snapshot = self._snapshot, None
        self._finish(snapshot, self._trained)

    # -- the pipeline path: a schedule step is one backward
    @contextlib.contextmanager
    def one_backward(self):
        """Treat every backward run inside the block as one, reduced when it ends."""
        params = self.params()
        snapshot = _snapshot(params)
        yield
        self._finish(snapshot, params)

    def _finish(self, snapshot: list, params: list[torch.Tensor]) -> None:
        if self.release_host_memory:  # the activations are freed now; their heap pages go back
            release_free_host_memory()
        for reduce in self._extra:
            reduce()
        if self.sum_partial_after_backward:
            self._sum_partial(snapshot)
        for p in params if parallel_state.get_expert_parallel_size() > 1 else ():
            if is_expert_parallel(p) and accumulated_grad(p) is None:  # no token reached these experts
                p.grad = torch.zeros_like(p)
        dp_size = parallel_state.get_data_parallel_size()
        if self.buckets is not None:
            self.buckets.finish(1.0 / dp_size)
        if self._reduces_dp():  # the rest (partial over TP, fp32 main_grad, experts): the DP mean (experts: expert_data)
            rest = [p for p in params if (self.buckets is None or p not in self.buckets)
                    and accumulated_grad(p) is not None]
            data_parallel_mean(rest, [accumulated_grad(p) for p in rest], bucket_size_mb=self.bucket_size_mb)

    def _sum_partial(self, snapshot: list) -> None:
        if not snapshot:  # tp=1: nothing is partial
            return
        fresh = [(accumulated_grad(p), before) for p, before in snapshot if accumulated_grad(p) is not None]
        deltas = [grad.detach() - (0 if before is None else before) for grad, before in fresh]
        all_reduce_bucketed(deltas, parallel_state.get_tensor_model_parallel_group(), bucket_size_mb=self.bucket_size_mb)
        for (grad, before), delta in zip(fresh, deltas):
            grad.detach().copy_(delta if before is None else before + delta)


def _bucketable(param: torch.Tensor) -> bool:
    """Gradients that go into the flat buckets: not fp32-accumulated, not summed over TP after
    backward, not reduced over another group (expert parallel)."""
    return (not hasattr(param, "main_grad") and not has_partial_grad_over_tp(param)
            and not getattr(param, "expert_parallel", False))


def _snapshot(params: list[torch.Tensor]) -> list:
    """(param, copy of its accumulated gradient or None) for the partial-gradient parameters,
    before a backward adds to them; none at tp=1, where no gradient is partial."""
    if parallel_state.get_tensor_model_parallel_size() == 1:
        return []
    result = []
    for p in params:
        if has_partial_grad_over_tp(p):
            grad = accumulated_grad(p)
            result.append((p, None if grad is None else grad.detach().clone()))
    return result


def grad_reductions_of(params) -> list[GradReduction]:
    """The policies of the models that own any of ``params`` (an optimizer registers with them)."""
    ids = {id(p) for p in params}
    return [policy for policy in list(_LIVE) if any(id(p) in ids for p in policy.params())]
