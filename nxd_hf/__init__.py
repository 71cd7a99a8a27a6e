"""nxd_hf: NeuronX-Distributed-style tensor, pipeline and data parallelism for Hugging Face models."""

from nxd_hf import parallel_state

__all__ = ["parallel_state"]
