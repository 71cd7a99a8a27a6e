"""Tensor-parallel plans as data: how one Hugging Face architecture is sharded.

A ``ModelPatch`` maps module-name patterns (``*`` matches one name, as in HF's
``base_model_tp_plan``) to styles. One generic function (``nxd_hf.tp.apply``) applies any
patch; ``nxd_hf/model_patches/`` holds one small module per architecture, registered in
``nxd_hf.tp.registry`` by ``model_type``.
"""

import dataclasses
from collections.abc import Callable
from typing import Literal

HeadRows = Literal["q", "kv", "qkv", "qkv_per_head", "q_gated", "head_blocks", None]
"""Which attention-head layout a projection's sharded rows follow: query heads, K/V heads
(replicated when num_kv_heads < tp), a stacked fused ``[q; k; v]``, GPT-NeoX's per-head
interleaved ``[q_h k_h v_h]``, a query fused per head with its output gate ``[q_h gate_h]``
(Qwen3.5; a "q" column twice the query size is taken as this), one block of any width per query
head, "head_blocks" (multi-head latent attention: ``nxd_hf.tp.mla``), or None for a plain contiguous
split (MLPs)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Column:
    """Replace an ``nn.Linear``/``Conv1D`` with a ColumnParallelLinear (outputs sharded)."""

    heads: HeadRows = None
    """Head layout of the output rows; None for a plain contiguous split."""
    stride: int = 1
    """Fused sub-tensors split separately, e.g. 2 for Phi-3's ``gate_up_proj``."""
    gather_output: bool = False
    """All-gather the output (HF's "colwise_rep")."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Row:
    """Replace an ``nn.Linear``/``Conv1D`` with a RowParallelLinear (inputs sharded)."""

    heads: HeadRows = None
    """Head layout of the input rows ("q" for an attention output projection)."""
    input_is_parallel: bool = True
    """False splits a full input first (HF's "rowwise_rep")."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Embedding:
    """Replace the token ``nn.Embedding`` with a vocab-sharded ParallelEmbedding."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class LMHead:
    """Replace the output projection with a vocab-sharded ColumnParallelLinear whose logits
    feed ``parallel_cross_entropy``; tied to the embedding when the config ties them."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ParallelRegion:
    """A module (an MLP) whose input enters the tensor-parallel region once for all the
    column-parallel layers inside it: copied (all-reduce backward), or under SP all-gathered
    along the sequence (reduce-scatter backward). Its HF ``forward`` then sees the full
    sequence, as it expects."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Attention(ParallelRegion):
    """An attention module: a ``ParallelRegion`` whose per-rank head counts change. ``attrs``
    maps an attribute (dotted paths into a private ``config`` copy allowed) to a local
    quantity: "num_heads", "num_kv_heads", "num_kv_groups", "q_size", "kv_size"."""

    attrs: tuple[tuple[str, str], ...] = (("num_key_value_groups", "num_kv_groups"),)


@dataclasses.dataclass(kw_only=True, frozen=True)
class PerHeadNorm:
    """A replicated norm applied per local head (Qwen3 ``q_norm``/``k_norm``): each TP rank sees
    different heads, so its gradient is summed over TP (HF's "replicated_with_grad_allreduce")."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Experts:
    """HF's fused mixture-of-experts module (3-D ``gate_up_proj`` [experts, 2 x intermediate,
    hidden] and ``down_proj`` [experts, hidden, intermediate], called with the router's top-k
    indices and weights): HF's "moe_tp_experts". Its plan entries for the 3-D parameters are
    folded into this one."""


Style = Column | Row | Embedding | LMHead | ParallelRegion | Attention | PerHeadNorm | Experts


@dataclasses.dataclass(kw_only=True)
class ModelPatch:
    """How one architecture is sharded."""

    model_type: str
    """``config.model_type`` this patch serves."""
    plan: dict[str, Style]
    """Module-name pattern (relative to the base model, ``*`` = one name) -> style."""
    base_model_prefix: str | None = None
    """Attribute of the task model holding the base model (default: HF's ``base_model_prefix``)."""
    lm_head: str | None = "lm_head"
    """Module name of the output projection in the task model, if any."""
    decoder_layers: str = "layers"
    """The ``nn.ModuleList`` of transformer layers (relative to the base model). Under sequence
    parallelism the sequence is split on entry to its first layer and gathered after its
    last, so HF's position, mask and output code outside the layers sees the full sequence."""
    sequence_parallel: bool = True
    """Whether the architecture can run with sequence parallelism (decoders)."""
    num_heads_attr: str = "num_attention_heads"
    """Config attribute holding the number of query heads."""
    num_kv_heads_attr: str | None = "num_key_value_heads"
    """Config attribute holding the number of K/V heads (None: same as query heads)."""
    after_swap: Callable | None = None
    """``fn(model)`` run after the swap for what a plan cannot say (Gemma 3n's activation
    sparsity takes statistics over the sharded hidden units: ``nxd_hf/model_patches/gemma3n.py``)."""
    pipeline_refusal: str | None = None
    """Why the decoder cannot be cut into pipeline stages (HRM: two layer stacks, each run several
    times per step); None: it can."""
