"""The head layout of each attention module: built from the module's own attributes when they
differ from the config-wide ones (gemma4's global layers have twice the sliding layers'
``head_dim``, and their own K/V head count)."""

from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.heads import HeadLayout, head_layout


def config_head_dim(config, num_heads: int) -> int:
    """``config.head_dim``, or ``hidden_size // num_heads``; a per-layer head_dim (transformers'
    heterogeneous configs refuse the global read) falls back too: each attention module then
    gets its own layout (``module_layout``)."""
    try:
        head_dim = getattr(config, "head_dim", None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        head_dim = None
    return head_dim or config.hidden_size // num_heads


def module_layout(attention: nn.Module, kv_projection: nn.Module | None, base: HeadLayout) -> HeadLayout:
    """``base`` unless ``attention.head_dim`` or its K/V projection's head count differ."""
    head_dim = getattr(attention, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) and head_dim > 0 else base.head_dim
    num_kv_heads = base.num_kv_heads
    if kv_projection is not None and hasattr(kv_projection, "out_features"):
        num_kv_heads = kv_projection.out_features // head_dim
    if (head_dim, num_kv_heads) == (base.head_dim, base.num_kv_heads):
        return base
    kv_size_multiplier = base.kv_size_multiplier if num_kv_heads == base.num_kv_heads else "auto"
    return head_layout(base.num_heads, num_kv_heads, head_dim, parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_tensor_model_parallel_size(), kv_size_multiplier=kv_size_multiplier)
