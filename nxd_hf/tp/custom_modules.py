"""What a swapped module did beyond its base class: kept or refused.

A planned module whose class overrides ``forward`` (an ``nn.Embedding``/``nn.Linear``
  subclass with its own behaviour) is never replaced by a layer that ignores it: Gemma's
  ``*TextScaledWordEmbedding`` (``embed_scale`` times the lookup) becomes a
  ``ScaledParallelEmbedding``; any other override is refused with a ValueError.
"""

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers import ParallelEmbedding
from nxd_hf.tp import plan


class ScaledParallelEmbedding(ParallelEmbedding):
    """A vocab-parallel embedding times ``embed_scale`` (Gemma's scaled word embedding):
    ``E(x) * scale``, the scale cast to the weight's dtype as HF does."""

    def __init__(self, *args, embed_scale: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", embed_scale.detach().clone().to("cpu"), persistent=False)

    @staticmethod
    def scale_of(module: nn.Module) -> torch.Tensor:
        """``module``'s scale as a real tensor: on the meta device the buffer holds no value, and
        HF keeps the number beside it (``scalar_embed_scale``)."""
        if not module.embed_scale.is_meta:
            return module.embed_scale
        if not isinstance(getattr(module, "scalar_embed_scale", None), (int, float)):
            raise ValueError(f"{type(module).__name__}.embed_scale is on the meta device and the module keeps no "
                             "scalar_embed_scale: build the model with its buffers on the CPU "
                             "(accelerate.init_empty_weights(include_buffers=False))")
        return torch.tensor(module.scalar_embed_scale, dtype=module.embed_scale.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _overrides_forward(module: nn.Module, base: type) -> bool:
    return isinstance(module, base) and type(module).forward is not base.forward


def _is_scaled_embedding(module: nn.Module) -> bool:
    return type(module).__name__.endswith("ScaledWordEmbedding") and torch.is_tensor(getattr(module, "embed_scale", None))


def check_kept(name: str, module: nn.Module, style) -> None:
    """ValueError when swapping ``module`` for a parallel layer would drop its own ``forward``."""
    if isinstance(style, plan.Embedding):
        if _overrides_forward(module, nn.Embedding) and not _is_scaled_embedding(module):
            raise ValueError(
                f"{name!r} is a {type(module).__name__}, an nn.Embedding whose forward does more than a lookup; "
                "a ParallelEmbedding would drop that. Leave it out of the plan (replicated) or register a "
                "hand-written patch with nxd_hf.register_patch"
            )
    elif _overrides_forward(module, nn.Linear):
        raise ValueError(
            f"{name!r} is a {type(module).__name__}, an nn.Linear with its own forward; a parallel linear would "
            "drop that behaviour. Leave it out of the plan (replicated) or register a hand-written patch"
        )


def build_embedding(module: nn.Module, dtype: torch.dtype) -> ParallelEmbedding:
    if _is_scaled_embedding(module):
        return ScaledParallelEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx, dtype=dtype,
                                       device="meta", embed_scale=ScaledParallelEmbedding.scale_of(module))
    return ParallelEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx, dtype=dtype,
                             device="meta")


def random_router(block: nn.Module) -> str | None:
    """Why ``block``'s router draws random numbers in training (None: it does not)."""
    if type(block).__name__.startswith("Phimoe"):
        return "PhiMoE's sparsemixer router samples experts at random in training"
    config = getattr(block, "config", None) or getattr(getattr(block, "experts", None), "config", None)
    for holder in (block, getattr(block, "gate", None), getattr(block, "router", None), config):
        for attr in ("jitter_noise", "router_jitter_noise", "input_jitter_noise"):
            if holder is not None and isinstance(getattr(holder, attr, None), float) and getattr(holder, attr) > 0:
                return f"{attr}={getattr(holder, attr)} multiplies by random noise"
    return None


def check_experts(name: str, module: nn.Module, block: nn.Module) -> None:
    """ValueError for fused experts that cannot be sharded over TP exactly (kept whole at tp=1)."""
    if parallel_state.get_tensor_model_parallel_size() == 1:
        return
    reason = random_router(block)
    if reason is not None:
        raise ValueError(
            f"{name!r}: {reason}; at tensor_parallel_size > 1 each TP rank would draw its own numbers and route "
            "tokens differently. Set the jitter to 0.0 in the config, or use tensor_parallel_size=1 for this model"
        )
