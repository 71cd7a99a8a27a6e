"""Context parallelism: the sequence of every batch split over the context-parallel (CP) ranks
of a replica, through attention itself (docs/context_parallel.md).

``split`` (which tokens each rank holds, and which key blocks each query block sees), ``ring``
(ring attention), ``ulysses`` (all-to-all attention), ``attention`` (both registered in
transformers' ``AttentionInterface``), ``model`` (the input split and the loss on an HF model).
The CP ranks are carved from the data-parallel ranks (``parallel_state``): gradients are averaged
over data x context parallelism by the usual data-parallel reduction.
"""

from nxd_hf.context.attention import as_kind
from nxd_hf.context.model import install_context_parallel  # noqa: F401


def check_context_parallel(context_parallel_size, context_parallel_attention, *, pipeline_parallel_size: int,
                           expert_parallel_size: int) -> None:
    """ValueError for sizes or combinations context parallelism does not take (yet)."""
    if (not isinstance(context_parallel_size, int) or isinstance(context_parallel_size, bool)
            or context_parallel_size < 1):
        raise ValueError(f"context_parallel_size must be an int >= 1, got {context_parallel_size!r}")
    as_kind(context_parallel_attention)
    if context_parallel_size == 1:
        return
