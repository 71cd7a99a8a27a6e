"""LoRA on nxd_hf's parallel layers through peft: exact sharded adapters, PEFT-format files.

peft is imported on first use (``import nxd_hf`` stays light): ``register_with_peft`` does it
when ``nxd_hf.parallelize`` runs, and the names below load their modules when accessed.
"""

import importlib
import importlib.util

_LAZY = {
    "inject_lora": "nxd_hf.lora.inject", "to_peft_config": "nxd_hf.lora.inject",
    "save_adapter": "nxd_hf.lora.save",
    "LoraColumnParallelLinear": "nxd_hf.lora.layers", "LoraRowParallelLinear": "nxd_hf.lora.layers",
    "LoRAModel": "nxd_hf.lora.model",
}


def register_with_peft() -> None:
    """Register nxd_hf's layers with peft's LoRA dispatch (see ``nxd_hf.lora.dispatch``);
    idempotent, and a no-op when peft is not installed."""
    if importlib.util.find_spec("peft") is None:
        return
    from nxd_hf.lora.dispatch import register_with_peft as register

    register()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nxd_hf.lora' has no attribute {name!r}")


__all__ = ["LoRAModel", "LoraColumnParallelLinear", "LoraRowParallelLinear", "inject_lora", "register_with_peft", "save_adapter",
           "to_peft_config"]
