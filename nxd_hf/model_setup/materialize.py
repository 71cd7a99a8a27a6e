"""Give meta-device modules real memory: only this rank's modules are ever materialized."""

import sys

import torch
from torch import nn

from nxd_hf.utils import owners_of


def has_meta_tensors(modules: list[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is on the meta device."""
    return any(t.is_meta for root in modules for t in (*root.parameters(), *root.buffers()))


def rebuild_all_meta_buffers(modules: list[nn.Module], buffer_init=None) -> None:
    """Recompute the meta buffers of ``modules`` (those no checkpoint holds, as RoPE's);
    ``buffer_init(module)`` fills those a module's config cannot rebuild (``rebuild_meta_buffers``)."""
    for root in modules:
        for module_name, module in root.named_modules():
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                rebuild_meta_buffers(module, module_name or type(module).__name__, buffer_init)


def materialize(modules: list[nn.Module], param_init_fn=None, *, device="cpu", buffer_init=None) -> None:
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
    rebuild_all_meta_buffers(modules, buffer_init)
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


def rebuild_meta_buffers(module: nn.Module, module_name: str, buffer_init=None) -> None:
    """Recompute a module's buffers (RoPE ``inv_freq``) by building the module again from its
    config. A module built from other arguments (a router's correction bias, an activation's
    constants) has its buffers filled by ``buffer_init(module)``, an HF model's own
    ``_init_weights``, which transformers uses to initialize buffers on its meta-device loads;
    the module's parameters are kept as they are."""
    config = getattr(module, "config", None)
    try:
        fresh = type(module)(config=config)
    except Exception as error:
        if buffer_init is None:
            raise ValueError(
                f"buffers of {module_name} ({type(module).__name__}) are on the meta device and cannot be rebuilt "
                "from the config: build the model with accelerate.init_empty_weights(include_buffers=False)"
            ) from error
        _init_buffers_in_place(module, module_name, buffer_init)
        return
    for name, buffer in fresh._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer


def _init_buffers_in_place(module: nn.Module, module_name: str, buffer_init) -> None:
    """Real buffers for the meta ones (NaN until ``buffer_init`` writes them: a float buffer it
    leaves alone is refused, never used uninitialized), parameters kept."""
    fresh = []
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            # HF keeps a constant buffer's number beside it (xIELU's ``_beta_scalar``, Gemma's ``scalar_embed_scale``)
            scalar = next((v for v in (getattr(module, f"_{name}_scalar", None), getattr(module, f"scalar_{name}", None))
                           if isinstance(v, (int, float))), None)
            empty = float("nan") if buffer.is_floating_point() else 0
            module._buffers[name] = torch.full_like(buffer, empty if scalar is None else scalar, device="cpu")
            fresh.append(name)
    kept = {name: p.detach().clone() for name, p in module.named_parameters(recurse=False)}
    buffer_init(module)
    with torch.no_grad():
        for name, value in kept.items():
            getattr(module, name).copy_(value)
    for name in fresh:
        if module._buffers[name].is_floating_point() and bool(module._buffers[name].isnan().any()):
            raise ValueError(f"buffer {module_name}.{name} ({type(module).__name__}) is on the meta device and neither "
                             "its config nor the model's _init_weights rebuilds it: build the model with "
                             "accelerate.init_empty_weights(include_buffers=False)")


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
