"""NxD's training API: ``neuronx_distributed_config``, ``initialize_parallel_model``,
``initialize_parallel_optimizer``."""

from nxd_hf.checkpoint import load_checkpoint, save_checkpoint
from nxd_hf.trainer.config import NxDConfig, neuronx_distributed_config
from nxd_hf.trainer.model import NxDModel, initialize_parallel_model
from nxd_hf.trainer.optimizer import NxDOptimizer, initialize_parallel_optimizer

__all__ = [
    "NxDConfig", "NxDModel", "NxDOptimizer", "initialize_parallel_model", "initialize_parallel_optimizer",
    "load_checkpoint", "neuronx_distributed_config", "save_checkpoint",
]
