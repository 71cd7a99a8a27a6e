"""``finish_parallel_model``: the one place a parallel model is finished. ``nxd_hf.parallelize``
(pp = 1), ``NxDPPModel`` (its local stages, however it was constructed), the config API's own
models and ``nxd_hf.nnscaler`` call it once the model is sharded and split: it runs steps 5-10
on this rank's modules (``local``), makes the model's ``NxDModelState`` with every field set,
puts it on the modules that carry it as ``.nxd`` (which then refuse DDP: ``nxd_hf.guards.no_ddp``),
marks their parameters (``torch.nn.utils.clip_grad_norm_`` on them is the whole model's:
``nxd_hf.parallel_layers.torch_clip``) and installs the gradient hooks."""

from collections.abc import Callable, Sequence
from typing import Literal

from torch import nn

from nxd_hf import parallel_state
from nxd_hf.guards.no_ddp import refuse_ddp
from nxd_hf.model_setup.local import LocalSetup, set_up_local_modules
from nxd_hf.model_state import NxDModelState
from nxd_hf.parallel_layers.torch_clip import mark_parallel_model


def finish_parallel_model(hf_model: nn.Module, local_modules: list[nn.Module], setup: LocalSetup, *,
                          carriers: Sequence[nn.Module], wrapper: Literal["plain", "pipeline"] = "plain",
                          layer_types: tuple[type, ...] = (), tie: Callable[[], None] | None = None,
                          hooks_on: nn.Module | None = None) -> NxDModelState:
    """Steps 5-10 on ``local_modules``, then the model's state (``setup.record`` holds what steps
    1-3 decided), set as ``.nxd`` of each of ``carriers`` and returned. ``hooks_on``: the module
    whose forward the gradient hooks follow (None: a pipeline, whose step reduces)."""
    policy, adapters = set_up_local_modules(local_modules, setup, layer_types=layer_types, tie=tie)
    mark_parallel_model(p for module in local_modules for p in module.parameters())  # torch's clip_grad_norm_ too
    record = setup.record
    state = NxDModelState(sizes=parallel_state.get_parallel_sizes(), hf_model=hf_model,
                          local_modules=list(local_modules), grad_reduction=policy, wrapper=wrapper,
                          patch=record.patch, head_layout=record.head_layout, input_check=record.input_check,
                          adapters=adapters)
    for carrier in carriers:
        carrier.nxd = state
        refuse_ddp(carrier)  # DDP would broadcast rank 0's shards over every rank
    if hooks_on is not None:
        policy.install_hooks(hooks_on)
    return state
