"""One small declarative module per Hugging Face architecture, registered by ``model_type``
on import (``nxd_hf.tp.plan.get_patch`` imports this package)."""

from model_patches import llama  # noqa: F401
