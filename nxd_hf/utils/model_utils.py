"""NxD's ``neuronx_distributed.utils.model_utils`` import path."""

from nxd_hf.utils import init_on_device

__all__ = ["init_on_device"]
