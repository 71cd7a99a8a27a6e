"""NxD's ``parallel_layers.utils`` import path: the helpers NxD users call from it. The
sharding metadata itself lives in ``nxd_hf.parallel_layers.sharding``."""

from nxd_hf.parallel_layers.sharding import divide, move_model_to_device

__all__ = ["divide", "move_model_to_device"]
