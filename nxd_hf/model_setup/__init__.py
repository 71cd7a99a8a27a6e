"""The setup steps every parallel model runs on this rank's modules (``local``), and their
pieces: materializing meta weights, activation checkpointing."""

from nxd_hf.model_setup.local import LocalSetup, set_up_local_modules, set_up_whole_module

__all__ = ["LocalSetup", "set_up_local_modules", "set_up_whole_module"]
