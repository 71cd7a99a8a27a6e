"""The one module that imports the bundled architecture patches (``nxd_hf/model_patches/``), which
register themselves in ``nxd_hf.tp.registry``. Generic code looks patches up there and never
imports a patch module."""

import nxd_hf.model_patches  # noqa: F401  registers the bundled patches

from nxd_hf.tp.registry import get_patch, register_patch, registered_model_types

__all__ = ["get_patch", "register_patch", "registered_model_types"]
