"""``fully_shard`` over the data-parallel group of an nxd_hf model (see the package docstring).

ZeRO-3: parameters, gradients and optimizer state sharded; each layer's parameters are
all-gathered before its forward and again before its backward (FSDP2's
``reshard_after_forward=True``). ZeRO-2: the same shards at rest, but a layer's gathered
parameters stay from its forward to its backward (``reshard_after_forward=False``: one
all-gather per layer and step, more memory during the step). In both, FSDP2's reduce-scatter
averages the gradients over the DP ranks, and a torch optimizer built on ``model.parameters()``
(DTensors) keeps its state for this rank's shards only.

Why it composes with nxd_hf's layers: ``fully_shard`` replaces each parameter by a DTensor
sharded along dim 0 over the DP mesh and, during forward and backward, by a plain unsharded
parameter of the TP-local shape. The layers never see the DTensor, so tensor and sequence
parallelism run unchanged. Two things need help:

- the new parameters lose nxd_hf's sharding metadata (``tensor_model_parallel``,
  ``partition_dim``, ``partial_grad_over_tp``, ...), which the gradient norm, ``full_tensor``
  and the checkpoints read: it is copied onto them;
- a replicated parameter whose gradient is partial per TP rank must be summed over TP, and
  after backward its unsharded gradient no longer exists: each backward's contribution is
  summed over TP by a hook on the unsharded parameter, before FSDP2 reduce-scatters it.
"""

import contextlib
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxd_hf import backend, parallel_state
from nxd_hf.fsdp.experts import expert_modules, shard_experts
from nxd_hf.fsdp.mesh import data_parallel_mesh, expert_data_mesh
from nxd_hf.parallel_layers.sharding import full_tensor, has_partial_grad_over_tp

DataParallelSharding = Literal["zero3", "zero2"]
DATA_PARALLEL_SHARDING = ("zero3", "zero2")
_HOOKED = "_nxd_tp_partial_hook"  # marks an unsharded parameter whose gradient hook is installed


def check_data_parallel_sharding(mode, *, expert_parallel_size: int, pipeline_kwargs=None, shard_size: int | None = None,
                                 offload: bool = False) -> None:
    """A clear ValueError for what ``data_parallel_sharding`` does not compose with (yet)."""
    if mode is None:
        if offload or shard_size is not None:
            raise ValueError("data_parallel_offload / data_parallel_shard_size need data_parallel_sharding='zero3' or "
                             "'zero2' (they configure FSDP2's sharding)")
        return
    if mode not in DATA_PARALLEL_SHARDING:
        raise ValueError(f"data_parallel_sharding must be one of {DATA_PARALLEL_SHARDING} or None, got {mode!r}")
    if (pipeline_kwargs or {}).get("use_zero1_optimizer"):
        raise ValueError(f"data_parallel_sharding={mode!r} already shards the optimizer state over the data-parallel "
                         "ranks: use a torch optimizer, not ZeRO-1 (use_zero1_optimizer)")
    if shard_size is not None and expert_parallel_size > 1 and shard_size % expert_parallel_size and \
            expert_parallel_size % shard_size:
        raise ValueError(f"data_parallel_shard_size={shard_size} with expert_parallel_size={expert_parallel_size}: one "
                         "must divide the other, so that every shard block holds as many ranks of each expert-data "
                         "group (the experts shard over those: docs/fsdp.md)")


def shard_data_parallel(model: nn.Module, mode: DataParallelSharding, *, policy,
                        layer_types: tuple[type, ...] | None = None, shard_size: int | None = None,
                        roots: list[nn.Module] | None = None, offload: bool = False) -> None:
    """``fully_shard`` every module of ``layer_types`` (default: the transformer layers, HF's
    ``_no_split_modules``) and then ``model`` over the DP group; ``policy`` (the model's
    ``GradReduction``) leaves the DP mean to FSDP2's reduce-scatter. ``shard_size``: hybrid
    sharding (HSDP), sharded over groups of that many DP ranks and replicated across the groups
    (``data_parallel_mesh``); None: over every DP rank. ``roots``: a pipeline's stage modules on
    this rank, each its own FSDP root (torch's pipeline stages drive FSDP2 themselves: no
    gradient sync during the step's microbatches, one reduce-scatter at its end); default ``[model]``.
    ``offload``: the shards (parameters, gradients, so the optimizer state) live in host memory
    between uses (FSDP2's ``CPUOffloadPolicy``; ``offload_policy``)."""
    from torch.distributed.fsdp import fully_shard

    pipeline = roots is not None
    roots = [model] if roots is None else roots
    layer_types = transformer_layer_types(model) if layer_types is None else layer_types
    if any(hasattr(p, "main_grad") for root in roots for p in root.parameters()):
        raise ValueError("data_parallel_sharding does not support fp32 gradient accumulation of bf16/fp16 parameters "
                         "(fp32_grad_accumulation / use_fp32_grad_acc): FSDP2 accumulates in its own gradient buffers; "
                         "train fp32 parameters (with bf16 autocast) or turn fp32 gradient accumulation off")
    mesh = data_parallel_mesh(shard_size)
    reshard = mode == "zero3"
    fsdp_kwargs = dict(reshard_after_forward=reshard, offload_policy=offload_policy(offload))
    experts_mesh = expert_data_mesh(shard_size) if parallel_state.get_expert_parallel_size() > 1 else None
    for root in roots:
        metadata = {name: dict(vars(p)) for name, p in root.named_parameters(remove_duplicate=False)}
        for module in expert_modules(root) if experts_mesh is not None else ():  # before their layers claim them
            shard_experts(module, experts_mesh, **fsdp_kwargs)
        for module in [m for m in root.modules() if layer_types and isinstance(m, layer_types)]:
            fully_shard(module, mesh=mesh, **fsdp_kwargs)
        fully_shard(root, mesh=mesh, **fsdp_kwargs)
        for name, param in root.named_parameters(remove_duplicate=False):
            for key, value in metadata[name].items():
                setattr(param, key, value)
        if parallel_state.get_tensor_model_parallel_size() > 1:
            _install_partial_sums(root)
    policy.reduce_in_optimizer()  # nobody else averages over DP: FSDP2's reduce-scatter does
    policy.sum_partial_after_backward = False  # the hooks above sum them over TP during backward
    if not pipeline:  # a pipeline's step reduce-scatters every time (linear: accumulation stays exact)
        model.no_sync = policy.no_sync = lambda: _no_sync(model)  # NxDTrainer's accumulation calls the policy's


def offload_policy(offload: bool):
    """FSDP2's policy: ``CPUOffloadPolicy`` (pinned host memory where the model computes on an
    accelerator: copies to and from it overlap) or the default, no offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=backend.default_device().type != "cpu")


def transformer_layer_types(model: nn.Module) -> tuple[type, ...]:
    """The module classes HF names in ``_no_split_modules`` (the decoder layers); none for a
    plain module (then only the root is sharded, as one group)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


@contextlib.contextmanager
def _no_sync(model):
    """Accumulate without reduce-scattering (DDP's ``no_sync``): FSDP2 keeps the unsharded
    gradients until the first backward outside the block."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _install_partial_sums(model: nn.Module) -> None:
    """Sum over TP each backward's gradient of the parameters marked partial over TP. During
    forward, a module's attribute is FSDP2's unsharded parameter (created once, reused every step):
    a forward pre-hook hooks it the first time it appears. The hook is on the FSDP module managing
    it, after FSDP2's own unshard: the owning module's forward may never run (peft's LoRA on a
    row-parallel layer calls its base layer's pieces, so a trained base bias stayed partial)."""
    from torch.distributed.fsdp import FSDPModule

    managing = {}  # module name -> the nearest FSDP module at or above it (pre-order: parents first)
    for name, module in model.named_modules():
        managing[name] = module if isinstance(module, FSDPModule) else managing[name.rpartition(".")[0]]
        names = [n for n, p in module.named_parameters(recurse=False) if has_partial_grad_over_tp(p)]
        if names:
            managing[name].register_forward_pre_hook(
                lambda _m, _args, owner=module, names=tuple(names): _hook_unsharded(owner, names))


def _hook_unsharded(module: nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        param = getattr(module, name)
        if isinstance(param, DTensor) or getattr(param, _HOOKED, False) or not param.requires_grad:
            continue
        param.register_hook(_sum_over_tp)
        setattr(param, _HOOKED, True)


def _sum_over_tp(grad: torch.Tensor) -> torch.Tensor:
    """This backward's partial gradient, summed over the TP group (in a copy: a hook must not
    change its argument)."""
    return backend.all_reduce(grad.clone(), parallel_state.get_tensor_model_parallel_group())


def is_dp_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its gradient) is sharded over the DP ranks by FSDP2."""
    return isinstance(tensor, DTensor)


def logical_tensor(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The whole (logical) ``tensor`` of ``param`` (default: ``param``; e.g. its grad): gathered
    over the DP ranks when FSDP2 shards it, then over TP (``full_tensor``). Every rank calls it."""
    tensor = param if tensor is None else tensor
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return full_tensor(param, tensor)
