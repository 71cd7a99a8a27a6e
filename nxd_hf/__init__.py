"""nxd_hf: NeuronX-Distributed-style tensor, pipeline and data parallelism for Hugging Face models."""

from nxd_hf import parallel_state
from nxd_hf.checkpoint import (
    consolidate, full_state_dict, load_checkpoint, save_checkpoint, save_pretrained, wait_for_checkpoint,
)
from nxd_hf.parallelize import parallelize
from nxd_hf.pretrained import from_pretrained
from nxd_hf.tp.plan import ModelPatch
from nxd_hf.tp.registry import register_patch
from nxd_hf.trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config

def __getattr__(name: str):
    if name in ("NxDTrainer", "NxDTrainingArguments"):  # transformers.Trainer loads on first use
        from nxd_hf import trainer

        return getattr(trainer, name)
    if name == "check_parity":  # loads on first use, so that import nxd_hf leaves the spawn harness out
        from nxd_hf.parity import check_parity

        return check_parity
    if name in ("NxDSFTTrainer", "NxDSFTConfig", "NxDDPOTrainer", "NxDDPOConfig", "NxDRewardTrainer",
                "NxDRewardConfig", "parallel_trainer", "parallel_arguments"):  # TRL: an optional extra
        from nxd_hf import integrations

        return getattr(integrations, name)
    if name == "LoRAModel":  # peft loads on first use
        from nxd_hf.lora.model import LoRAModel

        return LoRAModel
    raise AttributeError(f"module 'nxd_hf' has no attribute {name!r}")


__all__ = [
    "NxDTrainer", "NxDTrainingArguments", "NxDSFTTrainer", "NxDSFTConfig", "NxDDPOTrainer", "NxDDPOConfig",
    "NxDRewardTrainer", "NxDRewardConfig", "parallel_trainer", "parallel_arguments",
    "LoRAModel",
    "ModelPatch", "check_parity", "consolidate", "from_pretrained", "full_state_dict", "load_checkpoint",
    "save_checkpoint", "save_pretrained", "wait_for_checkpoint", "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "neuronx_distributed_config", "parallel_state", "parallelize", "register_patch",
]
from nxd_hf import plan  # noqa: E402  the layout search package: nxd_hf.plan.plan(model_or_config, world_size=..., ...)
from nxd_hf.plan import plan as plan_layout  # noqa: E402  the search itself, at the top: nxd_hf.plan_layout(...)
__all__ += ["plan", "plan_layout"]
