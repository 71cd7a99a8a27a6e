"""ZeRO-1: optimizer state sharded over data parallelism (NxD's ``NeuronZero1Optimizer``).

Each DP rank keeps an fp32 master copy and the optimizer state of only its 1/dp slice of the
flat parameters (``nxd_hf.optim.zero1.flat``). One ``step()``:

1. reduce-scatter the gradients over the sharding (DP) group, bucketed, and divide by dp (in
   one pass with the clipping): each rank gets the DP-mean gradient of its slice; expert-parallel
   parameters are sharded over the expert-data group instead (``zero1.experts``). By default each
   bucket's reduce-scatter starts during backward, once its gradients are complete
   (``optim.zero1.overlap``); ``step()`` then only waits for it;
2. if ``max_norm`` is set, clip on the norm of the whole model's gradient: slice norms summed
   over DP, then over the grad-norm (TP x PP) group, counting TP-replicated parameters once
   (on TP rank 0) and replicated K/V rows once, as ``parallel_layers.grads.get_grad_norm``;
3. step the inner ``optimizer_class`` on the master slices;
4. all-gather the updated slices back into the parameters, bucketed.

The reduce-scatter replaces the data-parallel mean at the end of backward: the optimizer
registers itself with the gradient-reduction policy of the models owning its parameters
(``nxd_hf.parallel_layers.grad_reduction``), whose TP sum of partial gradients stays on. The
step's collectives carry the ``backend.comm_tag`` "zero1".
"""


import torch

from nxd_hf import backend, parallel_state
from nxd_hf.model_state import state_of
from nxd_hf.optim.zero1.flat import FlatGroup, powered_sum
from nxd_hf.optim.groups import resolve_group
from nxd_hf.optim.zero1.experts import expert_sharding_group, split_flat_groups
from nxd_hf.optim.zero1.overlap import OverlappedReduceScatter
from nxd_hf.optim.zero1.state import Zero1State
from nxd_hf.parallel_layers.grad_reduction import grad_reductions_of
from nxd_hf.parallel_layers.sharding import is_expert_parallel
from nxd_hf.parallel_layers.grads import accumulated_grad, install_fp32_grad_accumulation

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
)
"""torch optimizers whose update of each element depends only on that element's history."""

OPTIMIZER_CHUNK_NUMEL = 1 << 18
"""fp32 elements per inner-optimizer param on CPU (1 MiB: a step's temporaries stay in L2)."""


def _check_elementwise(optimizer_class, elementwise: bool) -> None:
    if elementwise or optimizer_class in ELEMENTWISE_OPTIMIZERS:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"NeuronZero1Optimizer cannot shard {optimizer_class.__name__}: ZeRO-1 steps each rank's 1/dp slice of "
        "the flattened parameters alone, which is exact only for element-wise optimizers; an optimizer that "
        "needs whole-tensor statistics (LBFGS's line search and curvature history, Adafactor's row/column "
        f"factors, Muon's orthogonalization) would compute them on a slice. Supported: {names}. If "
        f"{optimizer_class.__name__} is element-wise, pass elementwise=True"
    )


class NeuronZero1Optimizer(torch.optim.Optimizer):
    """``optimizer_class`` with its state sharded over data parallelism.

    params: parameters or param groups, as for any torch optimizer (frozen params are ignored).
    optimizer_class: an element-wise torch optimizer class (AdamW, Adam, SGD, ...).
    sharding_groups: the group the state is sharded over; default the DP group. A process group
        or NxD's list of rank lists.
    grad_norm_groups: the group the grad norm is summed over besides DP; default TP x PP.
    pin_layout: accepted for NxD compatibility; no effect (an XLA collective-layout hint).
    optimizer_dtype: dtype of the master slices and the optimizer state; default float32.
    grad_clipping, max_norm: clip the global gradient norm to ``max_norm`` (default 1.0) when
        ``grad_clipping`` (default True), as torch-xla's ``ZeroRedundancyOptimizer``; ``norm_type`` its p.
    lazy_init: build the sharded layout on ``init_zero()`` instead of here (torch-xla's).
    bucket_size_mb: reduce-scatter / all-gather input size per collective. torch-xla's
        ``bucket_cap_mb_all_gather`` / ``bucket_cap_mb_reduce_scatter`` set it too (0: the default;
        one size serves both: the smaller one given).
    use_grad_acc_hook: accumulate low-precision gradients in an fp32 ``main_grad`` (torch-xla's).
    save_master_weights: the master slices go into checkpoints (torch-xla's; nxd_hf always saves them).
    higher_cc_precision: reduce-scatter low-precision gradients in ``optimizer_dtype`` (torch-xla's).
    elementwise: assert that an optimizer outside ``ELEMENTWISE_OPTIMIZERS`` is element-wise.
    model: a model from ``nxd_hf.parallelize`` whose DP gradient all-reduce to turn off (found
        from the parameters anyway; NxD's argument).
    grad_source: ``param -> accumulated gradient or None``; default ``param.grad`` (e.g. an fp32
        ``main_grad``: gradients are reduced in the dtype it returns).
    overlap_reduce_scatter: start each bucket's reduce-scatter during backward (HF path of a model
        from ``nxd_hf.parallelize``, outside ``no_sync()``); False: all in ``step()``. Gradients
        changed between backward and ``step()`` (other than by another backward) need False. The
        attribute of that name may be switched between steps when it was True at construction.
    defaults: ``optimizer_class``'s options (lr, weight_decay, ...).

    ``param_groups`` are this object's (lr schedulers work on it); their options are copied to
    the inner optimizer at every step. ``grad_norm`` holds the last step's norm before clipping.
    A parameter without a gradient is stepped with a zero gradient (torch's optimizers skip it).
    """

    shards_state_over_dp = True
    """The checkpoint's optimizer-state protocol: this rank's state is its slice (``param_states`` gathers)."""

    interleaved_layout = True
    """The flat layout (``optim.zero1.flat``): interleaved, in backward order (False: the contiguous one
    the earlier layout, without the overlapped reduce-scatter; kept to test loading its state_dicts)."""

    def __init__(self, params, optimizer_class, optimizer_dtype: torch.dtype | None = None, grad_clipping: bool = True,
                 max_norm: float | None = None, pin_layout=True, sharding_groups=None, grad_norm_groups=None,
                 lazy_init: bool = False, bucket_cap_mb_all_gather: float = 0, bucket_cap_mb_reduce_scatter: float = 0,
                 use_grad_acc_hook: bool = False, save_master_weights: bool = False, higher_cc_precision: bool = False,
                 *, norm_type: float = 2.0, bucket_size_mb: float = 25, elementwise: bool = False, model=None,
                 grad_source=None, overlap_reduce_scatter: bool = True, **defaults):
        _check_elementwise(optimizer_class, elementwise)
        if not grad_clipping and max_norm is not None:
            backend.warn_once(f"NeuronZero1Optimizer: max_norm={max_norm} is ignored with grad_clipping=False",
                              stacklevel=2)
        max_norm = (1.0 if max_norm is None else max_norm) if grad_clipping else None
        if max_norm is not None and max_norm <= 0:
            raise ValueError(f"max_norm must be positive (or grad_clipping=False: no clipping), got {max_norm}")
        given_caps = [c for c in (bucket_cap_mb_all_gather, bucket_cap_mb_reduce_scatter) if c]
        bucket_size_mb = min(given_caps) if given_caps else bucket_size_mb
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self._layout_done = False
        self.shard_state = Zero1State(self)
        super().__init__(params, defaults)
        if any(type(p).__name__ == "DTensor" for g in self.param_groups for p in g["params"]):  # ZeRO-2/3 (FSDP2)
            raise ValueError("NeuronZero1Optimizer: these parameters are already sharded over the data-parallel ranks "
                             "(data_parallel_sharding / FSDP): use a torch optimizer such as torch.optim.AdamW on them")
        self.max_norm, self.norm_type, self.pin_layout = max_norm, float(norm_type), pin_layout
        self.optimizer_dtype = optimizer_dtype or torch.float32
        self.save_master_weights, self.higher_cc_precision = save_master_weights, higher_cc_precision
        if use_grad_acc_hook:
            install_fp32_grad_accumulation(p for g in self.param_groups for p in g["params"])
            grad_source = grad_source or accumulated_grad
        self.grad_source = grad_source or (lambda p: p.grad)
        self.sharding_group = resolve_group(sharding_groups, "data")
        self.expert_sharding_group = expert_sharding_group(self.param_groups, self.sharding_group)
        self.grad_norm_group = resolve_group(grad_norm_groups, "model")
        self._init_args = (optimizer_class, bucket_size_mb, model, defaults)
        self.overlap_reduce_scatter = overlap_reduce_scatter
        self.inited = False
        if not lazy_init:
            self.init_zero()

    def init_zero(self) -> None:
        """Shard the parameters and build the inner optimizer (at construction unless ``lazy_init``)."""
        optimizer_class, bucket_size_mb, model, defaults = self._init_args
        self.dp_size, self.dp_rank = backend.group_size(self.sharding_group), backend.group_rank(self.sharding_group)
        if self.dp_size == 1:
            backend.warn_once(
                "NeuronZero1Optimizer: the sharding (data-parallel) group has one rank, so there is nothing to "
                "shard: this rank keeps the whole optimizer state (no memory saving). Use it with DP > 1",
                stacklevel=2,
            )
        self.flat_groups: list[FlatGroup] = self._build_flat_groups(bucket_size_mb, interleaved=self.interleaved_layout)
        if not self.flat_groups:
            raise ValueError("NeuronZero1Optimizer got no trainable parameters (all have requires_grad=False)")
        self._layout_done = True
        self.masters = [self._new_master(fg) for fg in self.flat_groups]
        self.optimizer = optimizer_class(
            [{**self._options(fg.group_index), "params": self._chunks(m)} for fg, m in zip(self.flat_groups, self.masters)],
            **defaults)
        for fg, inner in zip(self.flat_groups, self.optimizer.param_groups):  # show the inner defaults too
            for key, value in inner.items():
                self.param_groups[fg.group_index].setdefault(key, value)
        self.defaults = {**self.optimizer.defaults, **defaults}
        self._norm_segments = [fg.norm_segments(parallel_state.get_tensor_model_parallel_rank()) for fg in self.flat_groups]
        self.grad_norm: torch.Tensor | None = None
        self._staging_buffers: dict[tuple, torch.Tensor] = {}
        policies = grad_reductions_of(p for fg in self.flat_groups for p in fg.params)
        for policy in policies:
            policy.reduce_in_optimizer()
        if model is not None:
            self.attach(model)
        self._overlap = self._new_overlap(policies)
        self.inited = True

    def _new_overlap(self, policies: list) -> OverlappedReduceScatter | None:
        if not self.overlap_reduce_scatter or self.dp_size == 1 or not self.interleaved_layout:
            return None
        return OverlappedReduceScatter(self, policies)

    def add_param_group(self, param_group: dict) -> None:
        if self._layout_done:
            raise ValueError("NeuronZero1Optimizer's flat layout is fixed: pass every param group to the constructor")
        super().add_param_group(param_group)

    def attach(self, model) -> None:
        """Take over ``model``'s data-parallel gradient mean: the reduce-scatter in ``step()``
        replaces the one at the end of backward (``model.no_sync()`` then changes nothing)."""
        state = state_of(model)
        if state is None or state.grad_reduction is None:
            raise ValueError("attach(model) takes a model returned by nxd_hf.parallelize (it has no gradient reduction)")
        state.grad_reduction.reduce_in_optimizer()

    def _build_flat_groups(self, bucket_size_mb: float, interleaved: bool = True) -> list[FlatGroup]:
        return split_flat_groups(self.param_groups, sharding_group=self.sharding_group,
                                 expert_group=self.expert_sharding_group, bucket_size_mb=bucket_size_mb,
                                 interleaved=interleaved)

    def group_of(self, fg: FlatGroup):
        """The process group ``fg`` is sharded over (its reduce-scatter, all-gather, state gathers)."""
        return self.expert_sharding_group if is_expert_parallel(fg.params[0]) else self.sharding_group

    # -- state: the composed ``Zero1State`` (``zero1.state``)
    def optimizer_state_bytes(self) -> int:
        return self.shard_state.optimizer_state_bytes()

    def layout(self) -> dict:
        return self.shard_state.layout()

    def state_dict(self) -> dict:
        return self.shard_state.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.shard_state.load_state_dict(state_dict)

    def save_sharded_state_dict(self, output_dir: str, save_serially: bool = True) -> None:
        self.shard_state.save_sharded_state_dict(output_dir, save_serially)

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        self.shard_state.load_sharded_state_dict(output_dir, num_workers_per_step)

    def param_states(self):
        return self.shard_state.param_states()

    def load_param_states(self, states: dict[int, dict]) -> None:
        self.shard_state.load_param_states(states)

    def _options(self, group_index: int) -> dict:
        return {k: v for k, v in self.param_groups[group_index].items() if k != "params"}

    def _chunks(self, master: torch.Tensor) -> list[torch.Tensor]:
        """The inner optimizer's params: views of the master slice (and of its gradient) of
        ``OPTIMIZER_CHUNK_NUMEL`` elements on CPU, where an element-wise step over a cache-sized
        piece at a time runs ~4x faster than over one long tensor; the whole slice elsewhere."""
        size = OPTIMIZER_CHUNK_NUMEL if master.device.type == "cpu" else master.numel()
        chunks = list(master.split(size))
        for chunk, grad in zip(chunks, master.grad.split(size)):
            chunk.grad = grad
        return chunks

    def _new_master(self, fg: FlatGroup) -> torch.Tensor:
        master = torch.empty(fg.shard_numel, dtype=self.optimizer_dtype, device=fg.device)
        master.grad = torch.zeros_like(master)  # filled by the reduce-scatter
        staging = master if fg.dtype == master.dtype else torch.empty(fg.shard_numel, dtype=fg.dtype, device=fg.device)
        for lo, hi, at in fg.pieces():
            fg.read(lo, hi, staging[at : at + hi - lo], lambda p: p)
        if staging is not master:
            master.copy_(staging)
        return master

    # -- step
    @torch.no_grad()
    def step(self, closure=None):
        if not self.inited:
            raise ValueError("NeuronZero1Optimizer(lazy_init=True): call optimizer.init_zero() before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for fg, inner in zip(self.flat_groups, self.optimizer.param_groups):  # lr schedulers edit ours
            inner.update(self._options(fg.group_index))
        with backend.comm_tag("zero1"):
            if self._overlap is None or not self._overlap.take():  # else started in backward: done now
                for fg, master in zip(self.flat_groups, self.masters):
                    self._reduce_scatter_grads(fg, master)  # DP sums
            if self.max_norm is not None:
                self.grad_norm = self._clip_grad_norm(scale=1.0 / self.dp_size)  # one pass: mean and clip
            elif self.dp_size > 1:
                for master in self.masters:
                    master.grad.div_(self.dp_size)
            self.optimizer.step()
            for fg, master in zip(self.flat_groups, self.masters):
                self._all_gather_params(fg, master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and fp32 ``main_grad`` accumulators (Megatron's name)."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = None if set_to_none else p.main_grad.zero_()

    def _staging(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One bucket's collective buffer per (dtype, device), kept across steps."""
        numel = max(g.dp_size * g.bucket_numel for g in self.flat_groups)
        if (dtype, device) not in self._staging_buffers:
            self._staging_buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
        return self._staging_buffers[(dtype, device)]

    def reduce_dtype(self, fg: FlatGroup) -> torch.dtype:
        """The dtype ``fg``'s gradients are reduce-scattered in."""
        dtype = next((g.dtype for g in map(self.grad_source, fg.params) if g is not None), fg.dtype)
        master_dtype = self.masters[0].dtype
        if self.higher_cc_precision and dtype.itemsize < master_dtype.itemsize:
            dtype = master_dtype
        return dtype

    def _reduce_scatter_grads(self, fg: FlatGroup, master: torch.Tensor) -> None:
        grads = [self.grad_source(p) for p in fg.params]
        dtype = self.reduce_dtype(fg)
        source = dict(zip(map(id, fg.params), grads))
        staging = self._staging(dtype, fg.device)
        for c0, c1 in fg.buckets():
            width = c1 - c0
            for j in range(fg.dp_size):  # rank j's columns c0:c1
                start = fg.row_start(j, c0, c1)
                fg.read(start, start + width, staging[j * width : (j + 1) * width], lambda p: source[id(p)])
            out = master.grad[c0:c1] if dtype == master.dtype else torch.empty(width, dtype=dtype, device=fg.device)
            backend.reduce_scatter_into(out, staging[: fg.dp_size * width], self.group_of(fg))
            if out.dtype != master.dtype:
                master.grad[c0:c1].copy_(out)

    def _all_gather_params(self, fg: FlatGroup, master: torch.Tensor) -> None:
        staging = self._staging(fg.dtype, fg.device)
        for c0, c1 in fg.buckets():
            width = c1 - c0
            backend.all_gather_into(staging[: fg.dp_size * width], master[c0:c1].to(fg.dtype), self.group_of(fg))
            for j in range(fg.dp_size):
                start = fg.row_start(j, c0, c1)
                fg.write_params(start, start + width, staging[j * width : (j + 1) * width])

    def _clip_grad_norm(self, *, scale: float) -> torch.Tensor:
        """The norm of the whole model's gradient ``scale x`` the slices' (before clipping);
        multiplies the slices by ``scale`` and the clipping coefficient."""
        p = self.norm_type
        device = self.masters[0].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for master, segments in zip(self.masters, self._norm_segments):
            for lo, hi, weight in segments:
                grad = master.grad[lo:hi]
                if p == float("inf"):
                    total = torch.maximum(total, grad.abs().max())
                elif isinstance(weight, torch.Tensor):
                    total += (grad.abs().pow(p) * weight).sum()
                else:
                    total += powered_sum(grad, p) * weight
        op = "max" if p == float("inf") else "sum"
        backend.all_reduce(total, self.sharding_group, op=op)
        backend.all_reduce(total, self.grad_norm_group, op=op)
        norm = (total if p == float("inf") else total ** (1.0 / p)) * scale
        clip_coef = (self.max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for master in self.masters:
            master.grad.mul_(clip_coef * scale)
        return norm
