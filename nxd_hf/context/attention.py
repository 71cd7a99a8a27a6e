"""The context-parallel attention functions, registered in transformers' ``AttentionInterface``
as ``"nxd_cp_ring"`` and ``"nxd_cp_all_to_all"``: any HF model that looks its attention up in
``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation`` runs them.

Neither takes HF's mask: the names are not in ``AttentionMaskInterface``, so HF builds none,
and the mask comes from the current batch (``ContextBatch``: causality by global token index,
packed documents, padding keys) set by the model's input split (``nxd_hf.context.model``).
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor

from nxd_hf import parallel_state
from nxd_hf.context.ring import RingAttention
from nxd_hf.context.split import ContextBatch
from nxd_hf.context.ulysses import all_to_all_attention

IMPLEMENTATIONS = {"ring": "nxd_cp_ring", "all_to_all": "nxd_cp_all_to_all"}

_current: dict = {"batch": None}


def set_batch(batch: ContextBatch | None) -> None:
    """The batch the next forward's attention layers split (kept after the forward: activation
    checkpointing recomputes them in backward)."""
    _current["batch"] = batch


def current_batch() -> ContextBatch:
    batch = _current["batch"]
    if batch is None:
        raise ValueError("context-parallel attention ran without a split batch: call the model parallelized with "
                         "context_parallel_size > 1 (its forward splits the sequence), not a submodule of it")
    return batch


def _check_unsupported(module, dropout: float, kwargs: dict) -> None:
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{type(module).__name__} uses sliding-window attention, which context parallelism does not "
                         "support yet: use context_parallel_size=1 for this model")
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(f"{type(module).__name__} soft-caps its attention scores or has attention sinks, which "
                         "context parallelism does not support: use context_parallel_size=1 for this model")
    if dropout and module.training:
        raise ValueError(f"attention dropout ({dropout}) is not supported with context parallelism: set the "
                         "config's attention_dropout to 0.0")


def _attention(kind: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """q [b, hq, s/cp, d], k/v [b, hkv, s/cp, d] -> ([b, s/cp, hq, d], None), as HF's sdpa."""
        _check_unsupported(module, dropout, kwargs)
        if isinstance(query, FakeTensor) or query.device.type == "meta":
            # the pipeline's shape propagation (no batch, no peers): the output's shape and dtype
            return query.transpose(1, 2).contiguous(), None
        batch = current_batch()
        if query.shape[2] != 2 * batch.chunk:
            raise ValueError(f"context-parallel attention got {query.shape[2]} tokens but the current batch gives this "
                             f"rank {2 * batch.chunk}: call the model parallelized with context_parallel_size > 1 "
                             "(its forward splits the sequence), not a submodule of it")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        group = parallel_state.get_context_parallel_group()
        if kind == "ring":
            out = RingAttention.apply(query, key, value, batch, scale, group)
        else:
            out = all_to_all_attention(query, key, value, batch, scale, group)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"{IMPLEMENTATIONS[kind]}_attention"
    return attention


def register() -> None:
    """Register both functions with transformers (idempotent)."""
    from transformers import AttentionInterface

    for kind, name in IMPLEMENTATIONS.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _attention(kind))


def check_heads(kind: str, num_local_heads: int, cp_size: int, tp_size: int) -> None:
    """All-to-all splits each rank's heads over cp."""
    if kind == "all_to_all" and num_local_heads % cp_size != 0:
        raise ValueError(
            f"context_parallel_attention='all_to_all' splits the attention heads over the context-parallel ranks: "
            f"{num_local_heads} heads per tensor-parallel rank (tp={tp_size}) are not divisible by "
            f"context_parallel_size={cp_size}. Use context_parallel_attention='ring' (any head count), or heads "
            f"divisible by tp x cp = {tp_size * cp_size}")


def as_kind(context_parallel_attention) -> str:
    if context_parallel_attention not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"context_parallel_attention must be 'auto', 'ring' or 'all_to_all', got "
                         f"{context_parallel_attention!r}")
    return context_parallel_attention
