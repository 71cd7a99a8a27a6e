"""The progress bar and TensorBoard logger of one rank: the last pipeline stage's first TP and DP
rank (where NxD has the loss), or global rank 0 with the module's ``log_rank0``."""

import contextlib


from nxd_hf import backend, parallel_state
from nxd_hf.lightning.flavor import TensorBoardLogger, TQDMProgressBar, fabric_rank_zero_only, rank_zero_only


def logging_rank(log_rank0: bool = False) -> int:
    """The global rank that writes the progress bar and the logs."""
    if log_rank0:
        return 0
    return parallel_state.get_pipeline_model_parallel_group(as_list=True)[0][-1]  # TP/DP rank 0's last stage


def _logs_here(log_rank0: bool) -> bool:
    return parallel_state.model_parallel_is_initialized() and backend.rank() == logging_rank(log_rank0)


class NeuronTQDMProgressBar(TQDMProgressBar):
    """One bar, on ``logging_rank``."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if _logs_here(getattr(pl_module, "log_rank0", False)):
            self.enable()
        else:
            self.disable()


class NeuronTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger(save_dir)`` writing from ``logging_rank`` only (Lightning's writes from
    global rank 0). ``log_rank0`` follows the module's when it is a ``NeuronLTModule``."""

    def __init__(self, save_dir, log_rank0: bool = False, **kwargs):
        super().__init__(save_dir, **kwargs)
        self.log_rank0 = log_rank0

    @contextlib.contextmanager
    def _as_writer(self):
        """Lightning's rank-zero guards, pointed at this logger's rank for the call."""
        saved = rank_zero_only.rank, fabric_rank_zero_only.rank
        here = 0 if _logs_here(self.log_rank0) else 1
        rank_zero_only.rank = fabric_rank_zero_only.rank = here
        try:
            yield
        finally:
            rank_zero_only.rank, fabric_rank_zero_only.rank = saved

    @property
    def experiment(self):
        with self._as_writer():
            return super().experiment

    def log_metrics(self, metrics, step=None) -> None:
        with self._as_writer():
            super().log_metrics(metrics, step)

    def log_hyperparams(self, params, metrics=None) -> None:
        with self._as_writer():
            super().log_hyperparams(params, metrics)

    def save(self) -> None:
        with self._as_writer():
            super().save()

    def finalize(self, status: str) -> None:
        with self._as_writer():
            super().finalize(status)
