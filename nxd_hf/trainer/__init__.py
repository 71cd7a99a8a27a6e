"""NxD's training API: ``neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``; and the Hugging Face ``NxDTrainer`` / ``NxDTrainingArguments``
(imported on first use: ``transformers.Trainer`` is a heavy import)."""

from nxd_hf.checkpoint import load_checkpoint, save_checkpoint
from nxd_hf.trainer.config import NxDConfig, neuronx_distributed_config
from nxd_hf.trainer.model import NxDModel, initialize_parallel_model
from nxd_hf.trainer.optimizer import initialize_parallel_optimizer

_LAZY = {"NxDTrainer": "nxd_hf.trainer.hf_trainer", "NxDTrainingArguments": "nxd_hf.trainer.arguments"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nxd_hf.trainer' has no attribute {name!r}")


__all__ = [
    "NxDTrainer", "NxDTrainingArguments",
    "NxDConfig", "NxDModel", "initialize_parallel_model", "initialize_parallel_optimizer",
    "load_checkpoint", "neuronx_distributed_config", "save_checkpoint",
]
