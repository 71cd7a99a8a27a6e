"""nxd_hf: NeuronX-Distributed-style tensor, pipeline and data parallelism for Hugging Face models."""

from nxd_hf import parallel_state
from nxd_hf.parallelize import parallelize
from nxd_hf.pretrained import from_pretrained
from nxd_hf.tp.plan import ModelPatch, register_patch

__all__ = ["ModelPatch", "from_pretrained", "parallel_state", "parallelize", "register_patch"]
