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
                                       device="meta", embed_scale=module.embed_scale)
    return ParallelEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx, dtype=dtype,
                             device="meta")


def check_experts(name: str, module: nn.Module) -> None:
    """Fused experts are kept whole (replicated) at tp=1; sharding them over TP is not built yet."""
    if parallel_state.get_tensor_model_parallel_size() > 1:
        raise ValueError(
            f"{name!r}: a mixture-of-experts layer with experts sharded across TP (HF tensor-parallel style "
            "'moe_tp_experts') is not supported by nxd_hf yet at tensor_parallel_size > 1. Use "
            "tensor_parallel_size=1 (pipeline and data parallelism work), or the dense variant of the family "
            "(e.g. Qwen3 for Qwen3-MoE, Mistral for Mixtral)"
        )
