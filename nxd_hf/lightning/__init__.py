"""PyTorch Lightning on nxd_hf (the training-API document's "Neuron PyTorch-Lightning"), an optional
extra: ``pip install nxd_hf[lightning]``. Nothing else in nxd_hf imports this package.

``NeuronLTModule`` builds its model and optimizer through ``initialize_parallel_model`` /
``initialize_parallel_optimizer``; ``NxDStrategy`` (alias ``NeuronXLAStrategy``) sets up
``parallel_state`` in processes started by torchrun (no launcher of its own) and saves Lightning
checkpoints through ``nxd_hf.save_checkpoint``; the progress bar and TensorBoard logger write from
the one rank that logs (``logging_rank``). See docs/lightning.md."""

from nxd_hf.lightning.callbacks import NeuronTensorBoardLogger, NeuronTQDMProgressBar, logging_rank
from nxd_hf.lightning.module import NeuronLTModule
from nxd_hf.lightning.precision import NeuronXLAPrecisionPlugin
from nxd_hf.lightning.strategy import NeuronXLAStrategy, NxDStrategy, checkpoint_progress

__all__ = [
    "NeuronLTModule", "NeuronTensorBoardLogger", "NeuronTQDMProgressBar", "NeuronXLAPrecisionPlugin",
    "NeuronXLAStrategy", "NxDStrategy", "checkpoint_progress", "logging_rank",
]
