"""The setup steps every parallel model runs on this rank's modules (``local``), the one function
that finishes a parallel model with them (``finish``), and their pieces: materializing meta
weights, activation checkpointing."""

from nxd_hf.model_setup.finish import finish_parallel_model
from nxd_hf.model_setup.local import LocalSetup, SetupRecord, set_up_local_modules

__all__ = ["LocalSetup", "SetupRecord", "finish_parallel_model", "set_up_local_modules"]
