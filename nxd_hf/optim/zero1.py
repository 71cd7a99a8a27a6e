"""ZeRO-1: optimizer state sharded over data parallelism (NxD's ``NeuronZero1Optimizer``).

Each DP rank keeps an fp32 master copy and the optimizer state of only its 1/dp slice of the
flat parameters (``nxd_hf.optim.flat``). One ``step()``:

1. reduce-scatter the gradients over the sharding (DP) group, bucketed, and divide by dp: each
   rank gets the DP-mean gradient of its slice;
2. if ``max_norm`` is set, clip on the norm of the whole model's gradient: slice norms summed
   over DP, then over the grad-norm (TP x PP) group, counting TP-replicated parameters once
   (on TP rank 0) and replicated K/V rows once, as ``parallel_layers.grads.get_grad_norm``;
3. step the inner ``optimizer_class`` on the master slices;
4. all-gather the updated slices back into the parameters, bucketed.

The DP gradient average that ``parallelize``'s post-backward hook does would be redundant:
pass ``model=`` (or call ``attach(model)``) to turn it off; the hook's TP sum of
sequence-parallel partial gradients stays on. The step's collectives carry the
``backend.comm_tag`` "zero1".
"""

import warnings

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.optim.flat import FlatGroup, build_flat_groups
from nxd_hf.optim.groups import resolve_group

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
    max_norm: clip the global gradient norm to this (None: no clipping); ``norm_type`` its p.
    bucket_size_mb: reduce-scatter / all-gather input size per collective.
    elementwise: assert that an optimizer outside ``ELEMENTWISE_OPTIMIZERS`` is element-wise.
    model: a model from ``nxd_hf.parallelize`` whose DP gradient all-reduce to turn off.
    defaults: ``optimizer_class``'s options (lr, weight_decay, ...).

    ``param_groups`` are this object's (lr schedulers work on it); their options are copied to
    the inner optimizer at every step. ``grad_norm`` holds the last step's norm before clipping.
    A parameter without a gradient is stepped with a zero gradient (torch's optimizers skip it).
    """

    def __init__(self, params, optimizer_class, *, sharding_groups=None, grad_norm_groups=None, pin_layout=True,
                 max_norm: float | None = None, norm_type: float = 2.0, bucket_size_mb: float = 25,
                 elementwise: bool = False, model=None, **defaults):
        _check_elementwise(optimizer_class, elementwise)
        if max_norm is not None and max_norm <= 0:
            raise ValueError(f"max_norm must be positive or None (no clipping), got {max_norm}")
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self._layout_done = False
        super().__init__(params, defaults)
        self.max_norm, self.norm_type, self.pin_layout = max_norm, float(norm_type), pin_layout
        self.sharding_group = resolve_group(sharding_groups, "data")
        self.grad_norm_group = resolve_group(grad_norm_groups, "model")
        self.dp_size, self.dp_rank = backend.group_size(self.sharding_group), backend.group_rank(self.sharding_group)
        if self.dp_size == 1:
            warnings.warn(
                "NeuronZero1Optimizer: the sharding (data-parallel) group has one rank, so there is nothing to "
                "shard: this rank keeps the whole optimizer state (no memory saving). Use it with DP > 1",
                stacklevel=2,
            )
        self.flat_groups: list[FlatGroup] = build_flat_groups(
            self.param_groups, dp_size=self.dp_size, dp_rank=self.dp_rank, bucket_size_mb=bucket_size_mb)
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
        if model is not None:
            self.attach(model)

    def add_param_group(self, param_group: dict) -> None:
        if self._layout_done:
            raise ValueError("NeuronZero1Optimizer's flat layout is fixed: pass every param group to the constructor")
        super().add_param_group(param_group)

    def attach(self, model) -> None:
        """Turn off the DP gradient average of ``parallelize``'s post-backward hook: the
        reduce-scatter in ``step()`` replaces it (``model.no_sync()`` then changes nothing)."""
        sync = getattr(model, "_nxd_grad_sync", None)
        if sync is None:
            raise ValueError("attach(model) takes a model returned by nxd_hf.parallelize (it has no gradient sync hook)")
        sync.sync_dp = False

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
        master = torch.empty(fg.shard_numel, dtype=torch.float32, device=fg.device)
        master.grad = torch.zeros_like(master)  # filled by the reduce-scatter
        if fg.dtype == torch.float32:
            fg.read(fg.shard_start, fg.shard_start + fg.shard_numel, master, lambda p: p)
        else:
            staging = torch.empty(fg.shard_numel, dtype=fg.dtype, device=fg.device)
            fg.read(fg.shard_start, fg.shard_start + fg.shard_numel, staging, lambda p: p)
            master.copy_(staging)
        return master

    # -- step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for fg, inner in zip(self.flat_groups, self.optimizer.param_groups):  # lr schedulers edit ours
            inner.update(self._options(fg.group_index))
        with backend.comm_tag("zero1"):
            for fg, master in zip(self.flat_groups, self.masters):
                self._reduce_scatter_grads(fg, master)
            if self.max_norm is not None:
                self.grad_norm = self._clip_grad_norm()
            self.optimizer.step()
            for fg, master in zip(self.flat_groups, self.masters):
                self._all_gather_params(fg, master)
        return loss

    def _staging(self, fg: FlatGroup) -> torch.Tensor:
        """One bucket's collective buffer per (dtype, device), kept across steps."""
        key = (fg.dtype, fg.device)
        numel = max(g.dp_size * g.bucket_numel for g in self.flat_groups if (g.dtype, g.device) == key)
        if key not in self._staging_buffers:
            self._staging_buffers[key] = torch.empty(numel, dtype=fg.dtype, device=fg.device)
        return self._staging_buffers[key]

    def _reduce_scatter_grads(self, fg: FlatGroup, master: torch.Tensor) -> None:
        staging = self._staging(fg)
        for c0, c1 in fg.buckets():
            width = c1 - c0
            for j in range(fg.dp_size):  # row j of the [dp, shard] view: rank j's columns c0:c1
                start = j * fg.shard_numel + c0
                fg.read(start, start + width, staging[j * width : (j + 1) * width], lambda p: p.grad)
            out = master.grad[c0:c1] if fg.dtype == torch.float32 else torch.empty(width, dtype=fg.dtype, device=fg.device)
            backend.reduce_scatter_into(out, staging[: fg.dp_size * width], self.sharding_group)
            if out.dtype != torch.float32:
                master.grad[c0:c1].copy_(out)
        master.grad.div_(fg.dp_size)

    def _all_gather_params(self, fg: FlatGroup, master: torch.Tensor) -> None:
        staging = self._staging(fg)
        for c0, c1 in fg.buckets():
            width = c1 - c0
            backend.all_gather_into(staging[: fg.dp_size * width], master[c0:c1].to(fg.dtype), self.sharding_group)
            for j in range(fg.dp_size):
                start = j * fg.shard_numel + c0
                fg.write_params(start, start + width, staging[j * width : (j + 1) * width])

    def _clip_grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (before clipping); scales the slices' gradients."""
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
                    total += torch.linalg.vector_norm(grad, p) ** p * weight
        op = "max" if p == float("inf") else "sum"
        backend.all_reduce(total, self.sharding_group, op=op)
        backend.all_reduce(total, self.grad_norm_group, op=op)
        norm = total if p == float("inf") else total ** (1.0 / p)
        clip_coef = (self.max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for master in self.masters:
            master.grad.mul_(clip_coef)
        return norm

    # -- state
    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's per-element state: the fp32 master slices plus every state
        tensor of the master slices' size (Adam's exp_avg, exp_avg_sq; not scalar step counts)."""
        total = sum(m.numel() * m.element_size() for m in self.masters)
        for group in self.optimizer.param_groups:
            for chunk in group["params"]:
                for value in self.optimizer.state[chunk].values():
                    if isinstance(value, torch.Tensor) and value.numel() == chunk.numel():
                        total += value.numel() * value.element_size()
        return total

    def layout(self) -> dict:
        """What a saved shard must match to be loaded here."""
        return {
            "dp_size": self.dp_size, "dp_rank": self.dp_rank,
            "chunks": [len(group["params"]) for group in self.optimizer.param_groups],
            "groups": [{"group_index": fg.group_index, "dtype": str(fg.dtype), "numel": fg.numel,
                        "shard_numel": fg.shard_numel, "shapes": [list(p.shape) for p in fg.params]}
                       for fg in self.flat_groups],
        }

    def state_dict(self) -> dict:
        """This rank's shard: inner optimizer state, fp32 master slices, param group options
        and the layout they belong to."""
        return {
            "layout": self.layout(),
            "param_groups": [self._options(i) for i in range(len(self.param_groups))],
            "masters": [m.detach().clone() for m in self.masters],
            "inner": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        saved, here = state_dict["layout"], self.layout()
        if saved != here:
            diff = [k for k in here if saved.get(k) != here[k]]
            raise ValueError(
                f"this ZeRO-1 shard was saved for another layout (differs in {diff}): load it with the same "
                "data/tensor/pipeline parallel sizes, parameters and param groups it was saved with")
        self.optimizer.load_state_dict(state_dict["inner"])
        for master, saved_master in zip(self.masters, state_dict["masters"]):
            master.copy_(saved_master)
        for group, options in zip(self.param_groups, state_dict["param_groups"]):
            group.update(options)

    def save_sharded_state_dict(self, output_dir: str, save_serially: bool = True) -> None:
        """Every rank writes its shard to ``output_dir`` (one file per rank); ``save_serially``:
        one DP rank at a time."""
        from nxd_hf.checkpoint.zero1_shards import save_zero1_shard

        save_zero1_shard(self.state_dict(), output_dir, group=self.sharding_group, dp_rank=self.dp_rank,
                         dp_size=self.dp_size, save_serially=save_serially)

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Every rank reads its shard from ``output_dir``, at most ``num_workers_per_step`` ranks at a time."""
        from nxd_hf.checkpoint.zero1_shards import load_zero1_shard

        self.load_state_dict(load_zero1_shard(output_dir, dp_rank=self.dp_rank, device=self.masters[0].device,
                                              num_workers_per_step=num_workers_per_step))
