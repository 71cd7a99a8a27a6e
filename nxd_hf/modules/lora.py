"""NxD's ``neuronx_distributed.modules.lora.LoraConfig``: the config API's LoRA settings.

A plain dataclass (no peft import here, keeping ``modules/`` below ``lora/``);
``nxd_hf.lora.to_peft_config`` turns it into a ``peft.LoraConfig``. Differences from NxD:
``target_modules`` follow peft's matching rules (a name matches a module whose name is it or
ends with ``.name``; a single string is a full-match regex), where NxD matches substrings; the
default (None) is peft's per-architecture table, where NxD requires a list.
"""

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class LoraConfig:
    enable_lora: bool = False
    """Turn LoRA fine-tuning on; when False the other fields are ignored."""
    lora_rank: int = 16
    """Rank r of every adapter."""
    lora_alpha: float = 32
    """Scaling numerator: adapters are scaled by lora_alpha / r (or / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.05
    """Dropout probability on the adapters' input (0: none)."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases are trained: none, all, or those of the layers holding adapters."""
    target_modules: list[str] | str | None = None
    """Module names to adapt, by peft's rules (see the module docstring); None: peft's default for the architecture."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (e.g. a classifier head); peft's option."""
    use_rslora: bool = False
    """Rank-stabilized scaling lora_alpha / sqrt(r)."""
    init_lora_weights: Literal["default", "gaussian"] = "default"
    """A's init: kaiming-uniform ("default", as nn.Linear) or normal with std 1/r ("gaussian"); B starts at zero."""
    lora_verbose: bool = True
    """Print the trainable parameter counts when the adapters are created."""
    save_lora_base: bool = False
    """save_checkpoint also saves the base model (see merge_lora)."""
    merge_lora: bool = False
    """With save_lora_base: save the base model with the adapters merged in, instead of both separately."""
    save_lora_config_adapter: bool = True
    """Save adapter_config.json with the adapter; False: separately under lora_adapter/."""
    load_lora_from_ckpt: bool = False
    """Load the adapter from lora_save_dir / lora_load_tag when the model is built."""
    lora_save_dir: str | None = None
    """Checkpoint directory holding the adapter to load."""
    lora_load_tag: str | None = None
    """Sub-directory (tag) of lora_save_dir to load from."""

    def __post_init__(self):
        if self.lora_rank <= 0:
            raise ValueError(f"LoraConfig.lora_rank must be a positive integer, got {self.lora_rank}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"LoraConfig.bias must be 'none', 'all' or 'lora_only', got {self.bias!r}")
        if self.init_lora_weights not in ("default", "gaussian"):
            raise ValueError(f"LoraConfig.init_lora_weights must be 'default' or 'gaussian', got {self.init_lora_weights!r}")
        if self.merge_lora and not self.save_lora_base:
            raise ValueError("LoraConfig.merge_lora=True needs save_lora_base=True (it saves the merged base model)")
        if self.load_lora_from_ckpt and self.lora_save_dir is None:
            raise ValueError("LoraConfig.load_lora_from_ckpt=True needs lora_save_dir (and usually lora_load_tag)")
