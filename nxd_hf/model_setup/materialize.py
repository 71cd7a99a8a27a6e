"""Give meta-device modules real memory: only this rank's modules are ever materialized."""

import sys

import torch
from torch import nn

from nxd_hf.utils import owners_of


def has_meta_tensors(modules: list[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is on the meta device."""
    return any(t.is_meta for root in modules for t in (*root.parameters(), *root.buffers()))


def rebuild_all_meta_buffers(modules: list[nn.Module]) -> None:
    """Recompute the meta buffers of ``modules`` (those no checkpoint holds, as RoPE's)."""
    for root in modules:
        for module_name, module in root.named_modules():
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                rebuild_meta_buffers(module, module_name or type(module).__name__)


def materialize(modules: list[nn.Module], param_init_fn=None, *, device="cpu") -> None:
    """Allocate the meta parameters of ``modules`` on ``device`` (sharding metadata and ties kept),
    rebuild their meta buffers, then let ``param_init_fn(module)`` initialize each module's
    own parameters."""
    owners = owners_of(modules)
    touched = False
    for holders in owners.values():
        module, name = holders[0]
        param = getattr(module, name)
        if not param.is_meta:
            continue
        new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        for owner, attr in holders:
            setattr(owner, attr, new)
        touched = True
    rebuild_all_meta_buffers(modules)
    if touched and param_init_fn is None:
        raise ValueError("the model has meta-device parameters: pass param_init_fn to initialize them "
                         "(or load weights with nxd_hf.from_pretrained)")
    if param_init_fn is not None:
        seen = set()
        for root in modules:
            for module in root.modules():
                if id(module) not in seen:
                    seen.add(id(module))
                    param_init_fn(module)


def rebuild_meta_buffers(module: nn.Module, module_name: str) -> None:
    """Recompute a module's buffers (RoPE ``inv_freq``) by building the module again from its config."""
    config = getattr(module, "config", None)
    try:
        fresh = type(module)(config=config)
    except Exception as error:
        raise ValueError(
            f"buffers of {module_name} ({type(module).__name__}) are on the meta device and cannot be rebuilt "
            "from the config: build the model with accelerate.init_empty_weights(include_buffers=False)"
        ) from error
    for name, buffer in fresh._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer


def refuse_deferred_init(module: nn.Module) -> None:
    """ValueError for a model built by torchdistx's ``deferred_init`` (fake tensors, which
    nxd_hf does not materialize; torchdistx is unmaintained and built for torch 1.x)."""
    fake = sys.modules.get("torchdistx.fake")  # only a script that imported torchdistx can hold its fakes
    if fake is None:
        return
    if any(fake.is_fake(t) for t in (*module.parameters(), *module.buffers())):
        raise ValueError(
            "this model was built with torchdistx's deferred_init, which nxd_hf does not support: build it on the "
            "meta device instead — `with nxd_hf.utils.model_utils.init_on_device(torch.device('meta')): model = "
            "LlamaForCausalLM(config)` — and pass param_init_fn= (NxDPPModel / nxd_hf.parallelize) to initialize "
            "this rank's part, or load the weights with nxd_hf.from_pretrained")
