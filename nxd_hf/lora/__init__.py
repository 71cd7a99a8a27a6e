"""LoRA on nxd_hf's parallel layers through peft: exact sharded adapters, PEFT-format files."""

from nxd_hf.lora.dispatch import register_with_peft
from nxd_hf.lora.inject import inject_lora, to_peft_config
from nxd_hf.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear

__all__ = ["LoraColumnParallelLinear", "LoraRowParallelLinear", "inject_lora", "register_with_peft", "to_peft_config"]
