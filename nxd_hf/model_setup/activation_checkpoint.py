"""Activation checkpointing: chosen layers recompute their forward in backward."""

import functools

import torch
import torch.utils.checkpoint
from torch import nn


def decoder_layer_types(module: nn.Module, transformer_layer_cls=None) -> tuple[type, ...]:
    """The transformer layer classes: as given, else HF's ``_no_split_modules`` found in ``module``."""
    if transformer_layer_cls is not None:
        if isinstance(transformer_layer_cls, (list, tuple)):
            return tuple(transformer_layer_cls)
        return (transformer_layer_cls,)
    names = set(getattr(module, "_no_split_modules", None) or [])
    found = tuple({type(m) for m in module.modules() if type(m).__name__ in names})
    if not found:
        raise ValueError("pass transformer_layer_cls=<your decoder layer class>: it cannot be inferred for this model")
    return found


def checkpoint_types(config, layer_types: tuple[type, ...]) -> tuple[type, ...]:
    """The module classes ``config`` names: "full" (every transformer layer), a module class,
    or a list of classes."""
    if config == "full":
        return layer_types
    if isinstance(config, type):
        return (config,)
    if isinstance(config, (list, tuple)) and all(isinstance(c, type) for c in config):
        return tuple(config)
    raise ValueError(f"activation_checkpoint_config must be 'full', a module class or a list of classes, "
                     f"not {config!r}")


def checkpoint_layers(modules: list[nn.Module], types: tuple[type, ...]) -> None:
    """Recompute every module of ``types`` inside ``modules`` in backward."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, types) and not getattr(module, "_nxd_checkpointed", False):
                forward = module.forward
                module.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
                module._nxd_checkpointed = True
