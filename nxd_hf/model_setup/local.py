"""The setup steps that run on this rank's modules once the model is sharded and split into
pipeline stages: steps 5-10 of ``nxd_hf.parallelize``, which runs them on the whole model at
pp=1, while ``NxDPPModel`` runs them on its local stages (however it was constructed).

5. weights: ``load_weights(modules)`` fills this rank's meta parameters (``nxd_hf.from_pretrained``
   reads its slices of the files); otherwise meta parameters are materialized and
   ``param_init_fn`` initializes them; real weights stay as they are;
6. ties: ``tie()`` (weights shared by stages on different pipeline ranks start equal);
7. adapters: ``add_adapters(modules)`` (the LoRA slot; it returns their checkpoint protocol);
   then data-parallel replicas are checked to hold the same weights (``nxd_hf.model_setup.replicas``);
8. activation checkpointing of the layers ``activation_checkpoint_config`` names;
9. the gradient-reduction policy (``nxd_hf.parallel_layers.grad_reduction``), with fp32
   gradient accumulation for low-precision parameters when asked;
10. move to ``device``, keeping the sharding metadata.

The device defaults to the backend's compute device (``backend.default_device()``:
``cuda:LOCAL_RANK`` under nccl, the CPU under gloo), resolved before step 5 so meta weights
are materialized and loaded straight there; a model the user already put on an accelerator
stays where it is.
"""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nxd_hf import backend
from nxd_hf.model_setup.activation_checkpoint import checkpoint_layers, checkpoint_types
from nxd_hf.model_setup.materialize import has_meta_tensors, materialize, rebuild_all_meta_buffers
from nxd_hf.model_setup.replicas import check_replicas_equal
from nxd_hf.parallel_layers.grad_reduction import GradReduction
from nxd_hf.parallel_layers.grads import install_fp32_grad_accumulation
from nxd_hf.parallel_layers.sharding import move_model_to_device
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.guards.input_check import InputCheck
from nxd_hf.parallel_layers.heads import HeadLayout

if TYPE_CHECKING:  # the same layer: for the annotation only
    from nxd_hf.tp.plan import ModelPatch


@dataclasses.dataclass(kw_only=True, frozen=True)
class SetupRecord:
    """What the setup sequence decided before steps 5-10 (steps 1-3; None where not run), recorded
    in the model's ``NxDModelState`` by ``finish_parallel_model``."""

    patch: "ModelPatch | None" = None
    """The architecture patch that sharded the model."""
    head_layout: HeadLayout | None = None
    """This rank's attention-head layout."""
    input_check: InputCheck | None = None
    """The first-step input check."""
    on_hf_model: bool = False
    """The model given to ``NxDPPModel`` carries ``.nxd`` too (``nxd_hf.parallelize``: the user's object)."""


@dataclasses.dataclass(kw_only=True)
class LocalSetup:
    """What steps 5-10 do; every field's default leaves its step out."""

    load_weights: Callable[[list[nn.Module]], Any] | None = None
    """Fills the meta parameters and buffers of the given modules (step 5)."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """``fn(module)`` initializing a module's own parameters after materializing (NxD's)."""
    buffer_init: Callable[[nn.Module], None] | None = None
    """``fn(module)`` filling the meta buffers a module's config cannot rebuild (an HF model's own
    ``_init_weights``; ``materialize.rebuild_meta_buffers``)."""
    add_adapters: Callable[[list[nn.Module]], Any] | None = None
    """Adds adapters to the given modules and returns their checkpoint protocol, or None (step 7;
    the LoRA slot)."""
    activation_checkpoint_config: Any = None
    """None, "full" (every transformer layer), a module class or a list of classes."""
    fp32_grad_accumulation: bool = False
    """Accumulate the gradients of bf16/fp16 parameters in an fp32 ``main_grad``."""
    bucket_size_mb: float = 25
    """Bucket size of the gradient all-reduces."""
    dp_in_optimizer: bool = False
    """The optimizer does the data-parallel reduction (NxD's ``use_zero1_optimizer``)."""
    device: torch.device | str | None = None
    """Where the modules end up (None: ``target_device``'s default)."""
    check_replicas: bool = True
    """Check that data-parallel replicas hold the same weights (step 7); False when the weights
    are copied in after setup (nnScaler's ``init_params=False`` + ``broadcast_weights``)."""
    parameters_after_sharding: bool = False
    """The parameters stay on the meta device through these steps (``load_weights`` fills the
    buffers only, ``param_init_fn`` is not called here, the ties of step 6 wait; step 10 moves only
    the buffers): FSDP2 shards them afterwards and each rank then loads or initializes its DP shards
    (``nxd_hf.fsdp.load.fill_dp_shards``)."""
    record: SetupRecord = dataclasses.field(default_factory=SetupRecord)
    """What the steps before these decided, for the model's ``NxDModelState``."""


LocalResult = tuple[GradReduction, Any]
"""What steps 5-10 leave: the gradient policy and the adapters' checkpoint protocol (or None)."""


def set_up_local_modules(modules: list[nn.Module], setup: LocalSetup, *, layer_types: tuple[type, ...] = (),
                         tie: Callable[[], None] | None = None) -> LocalResult:
    """Run steps 5-10 on ``modules`` (see the module docstring); returns their gradient policy
    and adapters. ``layer_types``: the transformer layer classes ("full" activation checkpointing).
    ``nxd_hf.model_setup.finish_parallel_model`` calls it."""
    device = target_device(setup.device, modules)
    # the steps without collectives run inside fail_together: a rank failing there alone (user
    # code in load_weights / param_init_fn, a device out of memory) fails every rank with its error
    with fail_together("nxd_hf.parallelize (step 5: the weights)"):
        _weights(modules, setup, device)
    if tie is not None and not setup.parameters_after_sharding:  # else once the DP shards are filled
        tie()
    adapters = setup.add_adapters(modules) if setup.add_adapters is not None else None
    if setup.check_replicas:
        check_replicas_equal(modules)
    with fail_together("nxd_hf.parallelize (steps 8-10: checkpointing, gradient policy, device)"):
        return _finish(modules, setup, layer_types, device), adapters


def _weights(modules: list[nn.Module], setup: LocalSetup, device: torch.device | None) -> None:
    """Step 5."""
    if setup.load_weights is not None:
        setup.load_weights(modules)
        rebuild_all_meta_buffers(modules, setup.buffer_init)
    elif setup.parameters_after_sharding:  # param_init_fn runs on the DP shards (nxd_hf.fsdp.init)
        rebuild_all_meta_buffers(modules, setup.buffer_init)
    elif has_meta_tensors(modules) or setup.param_init_fn is not None:
        materialize(modules, setup.param_init_fn, device=device or "cpu", buffer_init=setup.buffer_init)


def _finish(modules: list[nn.Module], setup: LocalSetup, layer_types: tuple[type, ...],
            device: torch.device | None) -> GradReduction:
    """Steps 8-10."""
    if setup.activation_checkpoint_config is not None:
        checkpoint_layers(modules, checkpoint_types(setup.activation_checkpoint_config, layer_types))
    policy = GradReduction(modules, bucket_size_mb=setup.bucket_size_mb, dp_in_optimizer=setup.dp_in_optimizer)
    if setup.fp32_grad_accumulation:
        install_fp32_grad_accumulation(policy.params())
    if device is not None:
        for module in modules:
            if setup.parameters_after_sharding:
                _move_buffers(module, device)
            else:
                move_model_to_device(module, device)
    return policy


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def target_device(requested, modules: list[nn.Module]) -> torch.device | None:
    """Where step 10 puts ``modules``: ``requested``, else the backend's compute device; None
    (leave them) when they already hold real tensors on an accelerator (the user placed them)."""
    if requested is not None:
        return torch.device(requested)
    placed = {t.device.type for m in modules for t in (*m.parameters(), *m.buffers()) if not t.is_meta}
    if placed - {"cpu"}:
        return None
    return backend.default_device()
