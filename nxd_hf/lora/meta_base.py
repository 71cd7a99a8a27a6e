"""LoRA adapters added while the base model is still on the meta device (ZeRO-2/3: the base is
read or initialized into FSDP2's data-parallel shards after ``fully_shard``, ``nxd_hf.fsdp.load``).

peft creates each adapter on the CPU from the default generator (``nn.Linear`` construction of A
and B, then A's init), then moves it to the device of its base layer's weight: a meta base would
leave meta adapters, their values lost. While peft injects, every meta parameter is replaced by a
stand-in of the same shape, dtype and sharding metadata on the device the model goes to, holding
one element (``expand``: no memory): peft's draws and moves are then the ones it makes on a real
base, so the adapters equal plain peft's with the same seed, and the meta parameters are put back
(with the ``requires_grad`` peft gave the stand-ins). The base is never materialized.

With ``param_init_fn`` (the base initialized into the DP shards after ``fully_shard``), plain
peft on a model initialized without FSDP draws the adapters after the base's init: setup puts the
generator back where it was before injecting, and ``redraw_adapters`` draws every adapter again
once the base is initialized, in peft's order (the model's module order), as peft draws it. At
pipeline parallelism, as peft draws them on the whole model (``nxd_hf.lora.init_rng``): every target
of the whole model in its order, the other stages' drawn and dropped.

peft options that copy or read the base at injection are left to the materialized path
(``meta_base_refusal``): ``modules_to_save`` (a copy of the module), ``trainable_token_indices``
(rows of the embedding), ``target_parameters`` (the parameter wrapped), and NxD's
``load_lora_from_ckpt`` (which may load unmerged base tensors at setup)."""

import contextlib
import dataclasses

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.dp_shard import dp_rows, local_of
from nxd_hf.modules.lora import LoraConfig as NxDLoraConfig
from nxd_hf.parallel_layers.sharding import is_sharded, shard_from_full


def meta_base_refusal(lora_config) -> str | None:
    """Why adapters of ``lora_config`` cannot be added on a meta base (None: they can, or there are none)."""
    if lora_config is None:
        return None
    if isinstance(lora_config, NxDLoraConfig):
        if not lora_config.enable_lora:
            return None
        if lora_config.load_lora_from_ckpt:
            return "load_lora_from_ckpt"
        from nxd_hf.lora.inject import to_peft_config

        lora_config = to_peft_config(lora_config)
    reasons = [name for name in ("modules_to_save", "trainable_token_indices", "target_parameters")
               if getattr(lora_config, name, None)]
    return ", ".join(reasons) or None


@dataclasses.dataclass(kw_only=True)
class AdapterRedraw:
    """What step 7 records for ``redraw_adapters`` (``param_init_fn`` into the DP shards)."""

    base_modules: set[int] | None = None
    """The ids of the modules before peft injected (``param_init_fn`` is handed those only, not
    peft's wrappers and adapters: it never sees them without FSDP either); None: every module."""
    whole_model: tuple | None = None
    """Pipeline stages: (peft config, HF model, the whole model's target names in peft's order)."""


def has_meta_parameters(modules: list[nn.Module]) -> bool:
    return any(p.is_meta for m in modules for p in m.parameters())


@contextlib.contextmanager
def real_stand_ins(modules: list[nn.Module], device: torch.device):
    """Inside: every meta parameter of ``modules`` replaced by a one-element stand-in on ``device``
    (module docstring); on exit the meta parameters are back."""
    swapped = []  # (module, name, meta parameter, stand-in)
    for module in {id(m): m for root in modules for m in root.modules()}.values():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                stand_in = nn.Parameter(torch.empty((), dtype=param.dtype, device=device).expand(param.shape),
                                        requires_grad=param.requires_grad)
                stand_in.__dict__.update(vars(param))  # nxd_hf's sharding metadata (shard_index, ...)
                swapped.append((module, name, param, stand_in))
    shared = {}  # a parameter held by several modules (tied) gets one stand-in
    for module, name, param, stand_in in swapped:
        module._parameters[name] = shared.setdefault(id(param), stand_in)
    try:
        yield
    finally:
        for module, name, param, _ in swapped:
            param.requires_grad_(shared[id(param)].requires_grad)
            module._parameters[name] = param
    left = [name for root in modules for name, p in root.named_parameters() if _is_stand_in(p)]
    assert not left, f"peft copied base parameters while injecting: {left[:3]}"


def _is_stand_in(tensor: torch.Tensor) -> bool:
    return not tensor.is_meta and tensor.numel() > 1 and tensor.dim() > 0 and all(s == 0 for s in tensor.stride())


def hf_base_name(name: str) -> str | None:
    """The HF name of a base parameter of a model peft injected into (``q_proj.base_layer.weight``
    -> ``q_proj.weight``), None for an adapter's: what the DP-shard reader reads from the files."""
    from nxd_hf.lora.checkpoint import peft_base_name

    return peft_base_name(name, merged=False)


@torch.no_grad()
def redraw_adapters(roots: list[nn.Module], adapter_name: str = "default", whole_model: tuple | None = None) -> None:
    """Every LoRA adapter of ``roots`` (FSDP2's DTensors, allocated) drawn again from the generator
    as plain peft draws it on the whole model (module docstring): this rank's TP slice of the
    logical A and B, data-parallel rank 0's (as setup's broadcast), its DP rows kept.
    ``whole_model``: ``roots`` are pipeline stages (``AdapterRedraw.whole_model``)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import layer as peft_lora

    from nxd_hf.lora.init_rng import drawn_adapter, replay

    group = parallel_state.get_data_parallel_group()
    layers = [(root, m) for root in roots for m in root.modules()
              if isinstance(m, LoraLayer) and adapter_name in m.lora_A]
    other = {type(m.get_base_layer()).__name__ for _, m in layers if not isinstance(m, peft_lora.Linear)}
    if other:  # before any collective: every rank raises alike
        raise ValueError(f"param_init_fn with lora_config under data_parallel_sharding draws the adapters again after "
                         f"the base's init, which nxd_hf does for linear layers only, not {sorted(other)}: target "
                         "linear layers, or initialize without data_parallel_sharding")
    config_of = {id(m): root.peft_config[adapter_name] for root, m in layers}
    sequence = [m for _, m in layers]
    if whole_model is not None:  # every target of the whole model, in its order
        whole_config, hf_model, targets = whole_model
        by_name = {name: m for root in roots for name, m in root.named_modules() if id(m) in config_of}
        assert set(by_name) <= set(targets), sorted(set(by_name) - set(targets))[:3]
        sequence = [by_name.get(name, name) for name in targets]
    for module in sequence:
        if isinstance(module, str):  # another stage's layer: drawn as peft draws it, dropped
            replay(whole_config, module, hf_model.get_submodule(module))
            continue
        config = config_of[id(module)]
        base = module.get_base_layer()
        drawn = drawn_adapter(config, base, adapter_name=adapter_name, r=module.r[adapter_name],
                              alpha=module.lora_alpha[adapter_name], dtype=base.weight.dtype)
        for linear, value in zip((module.lora_A[adapter_name], module.lora_B[adapter_name]), drawn):
            param = linear.weight
            value = shard_from_full(value, param.partition_dim, param.shard_index) if is_sharded(param) else value
            local = local_of(param)
            value = value.to(device=local.device, dtype=local.dtype).contiguous()
            backend.broadcast(value, backend.global_rank(group, 0), group)
            start, count, _ = dp_rows(param)
            local.copy_(value[start:start + count])
