"""ZeRO-1: optimizer state sharded over data parallelism."""

from nxd_hf.optim.zero1 import ELEMENTWISE_OPTIMIZERS, NeuronZero1Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "NeuronZero1Optimizer"]
