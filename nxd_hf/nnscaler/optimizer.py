"""nnScaler's ``build_optimizer`` on nxd_hf's optimizers: ``NxDOptimizer`` (no ZeRO) or
``NeuronZero1Optimizer`` (``compute_config.use_zero``), each with nnScaler's extra methods.

The data-parallel gradient mean moves from the end of backward into the optimizer (it registers
with the models' gradient-reduction policies), where it is a ``Reducer`` with nnScaler's pre/post
hooks: each parallel module's gradients are averaged over data parallelism (all-reduce; under
ZeRO ZeRO-1's reduce-scatter, whose post hooks see each rank's reduced slice, then an all-gather
so ``.grad`` is the reduced gradient), the plain rest of the module (nnScaler's Example 2) by
``_non_parallel_module_reducer`` (all-reduce over data parallelism: inside a unit its replicas
saw the same input). ``sync_shard_grad()`` runs them once per backward (``step()`` calls it; a
new gradient or ``zero_grad()`` re-arms it, ``step()`` does not). ``clip_gnorm`` is the norm of the
original module's gradient (TP shards summed, TP replicas and replicated K/V rows once, a weight
tied across pipeline stages once, data-parallel replicas not summed) as
``torch.nn.utils.clip_grad_norm_`` computes it on the unparallelized module.
"""

import warnings
import weakref

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler.reducer import Reducer
from nxd_hf.nnscaler.state_dicts import EXTRA_STATE_KEY, add_extra_state_hooks
from nxd_hf.nnscaler.state_layout import original_param_names, parallel_parts, rank_info, tied_names, unique_entries
from nxd_hf.optim import ELEMENTWISE_OPTIMIZERS, NeuronZero1Optimizer, NxDOptimizer
from nxd_hf.parallel_layers.grads import all_reduce_bucketed, get_grad_norm

OPTIMIZER_EXTRA_KEY = EXTRA_STATE_KEY


class ParallelOptimizer:
    """What ``build_optimizer`` adds to nxd_hf's optimizers (see the module docstring); the type of
    its results (nnScaler's ``ParallelOptimizer``)."""

    def _init_nnscaler(self, module: nn.Module, params: list[torch.Tensor], names: dict[int, str],
                       non_parallel: list[torch.Tensor]) -> None:
        self._module, self._names, self._synced = module, names, False
        # As nnScaler's (its forward re-arms the sync): a new gradient re-arms sync_shard_grad, a
        # step does not, so clip_gnorm/sync_shard_grad after step() read the synchronized (and
        # scaled) gradients instead of reducing the local ones again.
        this = weakref.ref(self)
        self._grad_seen: set[int] = set()  # parameters given a gradient by a backward of this process

        def rearm(param):
            optimizer = this()
            if optimizer is not None:
                optimizer._synced = False
                optimizer._grad_seen.add(id(param))
        for p in params:
            p.register_post_accumulate_grad_hook(rearm)
        dp_group = parallel_state.get_data_parallel_group()
        self._non_parallel_module_reducer = Reducer(non_parallel, dp_group) if non_parallel else None
        self._non_parallel_ids = {id(p) for p in non_parallel}

    @property
    def all_reducers(self) -> list[Reducer]:
        return self.reducers + ([self._non_parallel_module_reducer] if self._non_parallel_module_reducer else [])

    def sync_shard_grad(self) -> None:
        """Reduce the gradients over data parallelism (once per backward; ``step()`` calls it)."""
        if not self._synced:
            self._sync()
            self._synced = True

    def scale_grads(self, scale: float) -> None:
        """Multiply the synchronized gradients by ``scale``."""
        if not self._synced:
            raise ValueError("scale_grads() scales the synchronized gradients: call optimizer.sync_shard_grad() first")
        for grad in self._stepped_grads():
            grad.mul_(scale)

    def register_reducer_pre_hook(self, fn) -> None:
        """``fn(reducer, grad)`` on each local gradient before its reduction."""
        for reducer in self.all_reducers:
            reducer.register_pre_hook(fn)

    def register_reducer_post_hook(self, fn) -> None:
        """``fn(reducer, grad)`` on each reduced gradient (under ZeRO: this rank's slice)."""
        for reducer in self.all_reducers:
            reducer.register_post_hook(fn)

    @torch.no_grad()
    def step(self, closure=None):
        """``sync_shard_grad()`` (unless called already), then the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_shard_grad()
        self._step_synced()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._synced = False

    def _extra_state(self) -> dict:
        groups = [[self._names[id(p)] for p in g["params"]] for g in self._outer_groups()]
        options = [{k: v for k, v in g.items() if k != "params"} for g in self._outer_groups()]
        return {"version": 1, **rank_info(), "optimizer": type(self.optimizer).__name__, "groups": groups,
                "group_options": options, "param_names": original_param_names(self._module),
                "tied": tied_names(self._module), **self._layout_extra()}


class PlainParallelOptimizer(ParallelOptimizer, NxDOptimizer):
    """``optimizer_fn``'s optimizer (``.optimizer``) on the module's parameters, without ZeRO."""

    def __init__(self, module, params, optimizer_fn, names, non_parallel, **kwargs):
        NxDOptimizer.__init__(self, [{"params": params}], optimizer_fn, max_grad_norm=None, use_master_weights=False,
                              **kwargs)
        self._init_nnscaler(module, params, names, non_parallel)
        self.reducers = []
        for _, part in parallel_parts(module):  # one reducer per parallel module, as nnScaler's
            mine = {id(p) for p in part.parameters()}
            held = [p for p in params if id(p) in mine and id(p) not in self._non_parallel_ids]
            reducers = [Reducer(held, parallel_state.get_data_parallel_group())] if held else []
            _set_reducers(part, reducers)
            self.reducers += reducers

    def _outer_groups(self):
        return self.optimizer.param_groups

    def _sync(self) -> None:
        for group in self.masters:
            group.load_grads()
        for reducer in self.all_reducers:
            reducer.sync_grads()

    def _stepped_grads(self):
        return [m.grad for group in self.masters for m in group.masters if m.grad is not None]

    @torch.no_grad()
    def clip_gnorm(self, max_norm: float | None = None) -> torch.Tensor:
        """The original module's gradient norm (see the module docstring); clipped to ``max_norm`` when given."""
        self.sync_shard_grad()
        masters = [m for group in self.masters for m in group.masters]
        parallel = [m for m in masters if id(m) not in self._non_parallel_ids]
        total = get_grad_norm(parallel) ** 2  # collective over TP x PP
        for m in masters:
            if id(m) in self._non_parallel_ids and m.grad is not None:
                total = total + m.grad.detach().float().pow(2).sum().to(total.device)
        norm = total.sqrt()
        if max_norm is not None and max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for grad in self._stepped_grads():
                grad.mul_(coef.to(grad.device, grad.dtype))
        return norm

    def _step_synced(self) -> None:
        self.optimizer.step()
        for group in self.masters:
            group.store_params()

    def state_dict(self) -> dict:
        """torch's format of ``optimizer_fn``'s optimizer plus this rank's layout (``NXD_HF_EXTRA_STATE``)."""
        return {**self.optimizer.state_dict(), OPTIMIZER_EXTRA_KEY: self._extra_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != OPTIMIZER_EXTRA_KEY})

    def _layout_extra(self) -> dict:
        return {"kind": "plain", "params": [self._names[id(p)] for group in self.masters for p in group.params]}


class ZeroParallelOptimizer(ParallelOptimizer, NeuronZero1Optimizer):
    """``optimizer_fn``'s optimizer on ZeRO-1's master slices (its ``parameters for optimizer``)."""

    def __init__(self, module, params, optimizer_fn, names, non_parallel, *, zero_use_reduce_scatter=False, **kwargs):
        NeuronZero1Optimizer.__init__(self, params, optimizer_fn, grad_clipping=False, overlap_reduce_scatter=False,
                                      **kwargs)  # nnScaler's reducers run the reduce-scatter
        self._init_nnscaler(module, params, names, non_parallel)
        self._zero_use_reduce_scatter = zero_use_reduce_scatter
        self.reducers = [Reducer([p for fg in self.flat_groups for p in fg.params], self.sharding_group,
                                 grad_of=self.grad_source, reduce=self._reduce_scatter)]
        for _, part in parallel_parts(module):  # one flat buffer: the parallel modules share its reducer
            _set_reducers(part, self.reducers)

    def _outer_groups(self):
        return self.param_groups

    def parameters_for_optimizer(self) -> list[torch.Tensor]:
        """The tensors ``optimizer_fn``'s optimizer steps: chunks of this rank's fp32 master slices."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _reduce_scatter(self, grads) -> list[torch.Tensor]:
        with backend.comm_tag("zero1"):
            for fg, master in zip(self.flat_groups, self.masters):
                self._reduce_scatter_grads(fg, master)
        for master in self.masters:
            master.grad.div_(self.dp_size)
        return [master.grad for master in self.masters]

    def _sync(self) -> None:
        if self._non_parallel_module_reducer is not None:  # then averaged again by the reduce-scatter: unchanged
            self._non_parallel_module_reducer.sync_grads()
        for reducer in self.reducers:
            reducer.sync_grads()
        if not self._zero_use_reduce_scatter:
            self._gather_grads()

    @torch.no_grad()
    def _gather_grads(self) -> None:
        """Every parameter's gradient becomes the reduced one (after the post hooks), as nnScaler's
        ZeRO all-reduce leaves it in the buffer its ``.grad`` views: one all-gather of the slices."""
        with backend.comm_tag("zero1"):
            for fg, master in zip(self.flat_groups, self.masters):
                staging = self._staging(master.grad.dtype, fg.device)
                for c0, c1 in fg.buckets():
                    width = c1 - c0
                    backend.all_gather_into(staging[: fg.dp_size * width], master.grad[c0:c1], self.group_of(fg))
                    for j in range(fg.dp_size):
                        start = fg.row_start(j, c0, c1)
                        piece = staging[j * width : (j + 1) * width]
                        for p, a, b, at in fg._overlapping(start, start + width):
                            grad = self.grad_source(p)
                            if grad is not None:
                                grad.view(-1)[a:b].copy_(piece[at : at + b - a])

    def _stepped_grads(self):
        return [master.grad for master in self.masters]

    @torch.no_grad()
    def clip_gnorm(self, max_norm: float | None = None) -> torch.Tensor:
        """The original module's gradient norm over the slices (see the module docstring)."""
        self.sync_shard_grad()
        saved, self.max_norm = self.max_norm, (max_norm if max_norm else float("inf"))
        try:
            return self._clip_grad_norm(scale=1.0)
        finally:
            self.max_norm = saved

    def _step_synced(self) -> None:
        for fg, inner in zip(self.flat_groups, self.optimizer.param_groups):  # lr schedulers edit ours
            inner.update(self._options(fg.group_index))
        self.optimizer.step()
        with backend.comm_tag("zero1"):
            for fg, master in zip(self.flat_groups, self.masters):
                self._all_gather_params(fg, master)

    def state_dict(self) -> dict:
        return {**super().state_dict(), OPTIMIZER_EXTRA_KEY: self._extra_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != OPTIMIZER_EXTRA_KEY})

    def _layout_extra(self) -> dict:
        # ZeRO-1 steps every parameter of the flat buffer; torch's optimizers give no state to one
        # that never had a gradient. Those are named, so the merge leaves out their (zero) state.
        flat = [{"names": [self._names[id(p)] for p in fg.params], "offsets": list(fg.offsets),
                 "shapes": [list(p.shape) for p in fg.params], "pieces": fg.pieces(),
                 "shard_numel": fg.shard_numel,
                 "no_grad": [self._names[id(p)] for p in fg.params if id(p) not in self._grad_seen]}
                for fg in self.flat_groups]
        return {"kind": "zero1", "flat_groups": flat}


def _set_reducers(part: nn.Module, reducers: list[Reducer]) -> None:
    """A ParallelModule's ``reducers`` (nnScaler's attribute): those of the optimizer built last."""
    if "reducers" in part.__dict__:
        part.__dict__["reducers"] = list(reducers)


def _elementwise(optimizer_fn, kwargs: dict) -> bool:
    """Whether ZeRO-1 may shard ``optimizer_fn``'s state: a class is checked by ZeRO-1 itself; a
    factory is asked for the class it builds (on a one-element probe)."""
    if isinstance(optimizer_fn, type):
        return False
    probe = optimizer_fn([torch.zeros(1, device="cpu", requires_grad=True)], **kwargs)
    if type(probe) not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(f"use_zero shards the optimizer state element by element, exact only for element-wise "
                         f"optimizers; optimizer_fn builds a {type(probe).__name__}. Use one of "
                         f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}, or use_zero=False")
    return True


def build_optimizer(module: nn.Module, optimizer_fn, compute_config=None, **kwargs):
    """nnScaler's ``build_optimizer``: ``optimizer_fn(params, **kwargs)`` (a class or factory) over
    ``module``'s trainable parameters, inside nxd_hf's optimizer (``PlainParallelOptimizer``, or
    ``ZeroParallelOptimizer`` when ``compute_config.use_zero``; both are ``ParallelOptimizer``s).
    ``compute_config`` defaults to the ``compute_config`` of ``module`` or of its first parallel part. ``module`` is, or holds, modules parallelized by nxd_hf."""
    if not parallel_parts(module):
        raise ValueError(f"build_optimizer: {type(module).__name__} holds no module parallelized by nxd_hf (no "
                         "`.nxd`): parallelize it (nxd_hf.nnscaler.parallelize or nxd_hf.parallelize) first, or use a "
                         "plain torch optimizer")
    configs = [getattr(m, "compute_config", None) for m in (module, *(part for _, part in parallel_parts(module)))]
    config = compute_config if compute_config is not None else next((c for c in configs if c is not None), None)
    use_zero = bool(getattr(config, "use_zero", False))
    add_extra_state_hooks(module)
    entries = [(n, t, par) for n, t, par in unique_entries(module) if isinstance(t, nn.Parameter) and t.requires_grad]
    if not entries:
        raise ValueError("build_optimizer: the module has no trainable parameters (all have requires_grad=False)")
    params = [t for _, t, _ in entries]
    names = {id(t): n for n, t, _ in entries}
    non_parallel = [t for _, t, par in entries if not par]
    if use_zero:
        if parallel_state.get_data_parallel_size() == 1:
            warnings.warn("build_optimizer: use_zero with one data-parallel replica shards nothing", stacklevel=2)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="NeuronZero1Optimizer: the sharding")  # warned above
            return ZeroParallelOptimizer(module, params, optimizer_fn, names, non_parallel,
                                         zero_use_reduce_scatter=bool(getattr(config, "zero_use_reduce_scatter", False)),
                                         elementwise=_elementwise(optimizer_fn, kwargs), **kwargs)
    return PlainParallelOptimizer(module, params, optimizer_fn, names, non_parallel, **kwargs)
