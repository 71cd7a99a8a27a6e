"""NxD's ``neuronx_distributed.utils.logger`` import path: the ``nxd_hf`` logger."""

import logging


def get_logger(name: str = "nxd_hf") -> logging.Logger:
    """The logger nxd_hf's messages go to (a child of it for another ``name``)."""
    return logging.getLogger(name if name == "nxd_hf" or name.startswith("nxd_hf.") else f"nxd_hf.{name}")


__all__ = ["get_logger"]
