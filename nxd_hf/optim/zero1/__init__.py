"""ZeRO-1 (NxD's ``NeuronZero1Optimizer``): the optimizer and its step (``optimizer``), its flat
layouts (``flat``), expert-parallel sharding (``experts``), the reduce-scatter overlapped with
backward (``overlap``), its state (``state``; ``relayout`` reads the earlier layout's
state_dicts) and its sharded checkpoint files (``checkpoint``)."""

from nxd_hf.optim.zero1.optimizer import ELEMENTWISE_OPTIMIZERS, NeuronZero1Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "NeuronZero1Optimizer"]
