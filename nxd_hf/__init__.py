"""nxd_hf: NeuronX-Distributed-style tensor, pipeline and data parallelism for Hugging Face models."""

from nxd_hf import parallel_state
from nxd_hf.parallelize import parallelize
from nxd_hf.pretrained import from_pretrained
from nxd_hf.testing.check import check_parity
from nxd_hf.tp.plan import ModelPatch
from nxd_hf.tp.registry import register_patch
from nxd_hf.trainer import initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config

__all__ = [
    "ModelPatch", "check_parity", "from_pretrained", "initialize_parallel_model", "initialize_parallel_optimizer",
    "neuronx_distributed_config", "parallel_state", "parallelize", "register_patch",
]
