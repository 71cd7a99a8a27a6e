"""One small declarative module per Hugging Face architecture, registered by ``model_type``
on import (``nxd_hf.architectures`` imports this package)."""

from nxd_hf.model_patches import llama  # noqa: F401
from nxd_hf.model_patches import mistral, qwen2, qwen3  # noqa: F401
from nxd_hf.model_patches import bert, gpt2, gpt_neox, phi3  # noqa: F401
from nxd_hf.model_patches import gemma3n  # noqa: F401
from nxd_hf.model_patches import doge  # noqa: F401
from nxd_hf.model_patches import gpt_oss  # noqa: F401
