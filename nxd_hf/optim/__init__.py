"""Optimizers: ZeRO-1 (optimizer state sharded over data parallelism) and ``NxDOptimizer`` (the
config API's, over fp32 masters). Both answer for their state through the checkpoint's
optimizer-state protocol (``nxd_hf.checkpoint.optim_state``)."""

from nxd_hf.optim.nxd_optimizer import NxDOptimizer
from nxd_hf.optim.zero1 import ELEMENTWISE_OPTIMIZERS, NeuronZero1Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "NeuronZero1Optimizer", "NxDOptimizer"]
