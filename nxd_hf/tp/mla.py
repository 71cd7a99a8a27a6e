"""Multi-head latent attention (MLA: DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite, LongCat, Youtu, ...)
in a plan derived from HF's ``base_model_tp_plan`` (HF style "mla_kv_a_proj").

An MLA module compresses the hidden states with replicated low-rank down-projections
(``q_a_proj`` + ``q_a_layernorm``; ``kv_a_proj_with_mqa`` whose output is the K/V latent and the
rope part of the key, one head shared by all heads, + ``kv_a_layernorm``) and expands them per
head with up-projections whose rows are one contiguous block per head of any width
(``q_b_proj``/``q_proj``: ``[q_nope_h; q_rope_h]``; ``kv_b_proj``: ``[k_nope_h; v_h]``). So:

- the module is an ``Attention`` region whose local ``num_heads`` is this rank's heads;
- every column-parallel child is sharded by head blocks (``Column(heads="head_blocks")``), the
  output projection reads the ``[v_h]`` blocks (``Row(heads="head_blocks")``); heads that tp
  does not divide are padded with zero heads (a zero query and value: the head adds nothing);
- the down-projections and their norms stay whole on every rank (``PerHeadNorm``): each rank
  back-propagates through its own heads only, so their gradients are summed over TP.

Any other child module with parameters that the plan does not name is refused: where it sits
relative to the heads cannot be told. Under sequence parallelism the region
gathers the sequence like any attention, so MLA runs with SP too.
"""

import dataclasses

from torch import nn

from nxd_hf import parallel_state
from nxd_hf.tp.plan import Attention, Column, PerHeadNorm, Row

LATENT_STYLE = "mla_kv_a_proj"
DOWN_PROJECTIONS = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "indexer")
"""The replicated parts (only ``kv_a_proj_with_mqa`` is named by HF's plans): the low-rank
down-projections and DeepSeek sparse attention's ``indexer``, which picks the top-k keys from the
hidden states and the query latent (both whole on every rank) for all heads alike."""

# Plans that leave their MLA attention out (DeepSeek-V3, Youtu): the entries HF's other MLA plans have.
_IMPLIED = {"q_proj": "colwise", "q_b_proj": "colwise", "kv_a_proj_with_mqa": LATENT_STYLE,
            "kv_b_proj": "colwise", "o_proj": "rowwise"}


@dataclasses.dataclass(kw_only=True, frozen=True)
class LatentAttention(Attention):
    """An MLA module: an ``Attention`` region whose only per-rank count is its query heads (keys
    and values are expanded per query head, so HF's ``num_key_value_groups`` stays as it is)."""

    attrs: tuple[tuple[str, str], ...] = (("num_heads", "num_heads"),)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def with_implied_entries(hf_plan: dict[str, str], decoder_layers: str, config) -> dict[str, str]:
    """``hf_plan`` plus MLA entries for ``{decoder_layers}.*.self_attn`` when the config is an MLA
    one (``kv_lora_rank``) with a single kind of attention layer and the plan names no attention."""
    if config is None or any(".self_attn" in p or LATENT_STYLE in s for p, s in hf_plan.items()):
        return hf_plan
    try:
        kv_lora_rank = getattr(config, "kv_lora_rank", None)
    except RuntimeError:  # a per-layer value (heterogeneous config): not one kind of attention layer
        return hf_plan
    other_kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if not kv_lora_rank or other_kinds:
        return hf_plan  # Kimi-Linear: its linear-attention layers are self_attn too
    parent = f"{decoder_layers}.*.self_attn"
    return {**hf_plan, **{f"{parent}.{leaf}": style for leaf, style in _IMPLIED.items()}}


def latent_parents(hf_plan: dict[str, str]) -> set[str]:
    """The MLA modules: parents of an "mla_kv_a_proj" entry."""
    return {_parent(p) for p, s in hf_plan.items() if s == LATENT_STYLE}


def _child_style(pattern: str, style: str, parent: str):
    if style in ("colwise", "local_colwise"):
        return Column(heads="head_blocks")
    if style in ("rowwise", "local_rowwise"):
        return Row(heads="head_blocks")
    if style in (LATENT_STYLE, "replicated_with_grad_allreduce"):
        return PerHeadNorm()
    raise ValueError(
        f"{pattern!r}: HF tensor-parallel style {style!r} inside the multi-head latent attention module {parent!r} "
        "is not supported by nxd_hf (only per-head colwise projections, one rowwise output projection and "
        "replicated down-projections/norms are). Use tensor_parallel_size=1, or register a hand-written patch "
        "with nxd_hf.register_patch"
    )


def latent_plan(hf_plan: dict[str, str], parents: set[str]) -> dict:
    """Our styles for every MLA module of ``parents`` and its children (see module doc)."""
    plan = {}
    for parent in sorted(parents):
        plan[parent] = LatentAttention()
        children = {p: s for p, s in hf_plan.items() if _parent(p) == parent}
        rows = [p for p, s in children.items() if s in ("rowwise", "local_rowwise")]
        if len(rows) > 1:
            raise ValueError(
                f"multi-head latent attention module {parent!r} has several rowwise layers {rows}; nxd_hf shards "
                "only its output projection by heads. Use tensor_parallel_size=1 or register a hand-written patch")
        plan.update({p: _child_style(p, s, parent) for p, s in children.items()})
        for leaf in DOWN_PROJECTIONS:
            plan.setdefault(f"{parent}.{leaf}", PerHeadNorm())
    return plan


def check_latent_attention(name: str, module: nn.Module, planned: set[str]) -> None:
    """ValueError unless ``module`` is MLA whose parameterized children are all planned (at tp=1
    nothing is sharded: any child is fine)."""
    if not isinstance(getattr(module, "kv_b_proj", None), nn.Module):
        raise ValueError(
            f"{name!r} ({type(module).__name__}) is planned as multi-head latent attention but has no kv_b_proj; "
            "register a hand-written patch with nxd_hf.register_patch")
    if parallel_state.get_tensor_model_parallel_size() == 1:
        return
    children = {p for p in planned if p.startswith(name + ".")}
    for sub_name, sub in module.named_modules():
        full = f"{name}.{sub_name}"
        if sub_name and full not in children and any(True for _ in sub.parameters(recurse=False)) and not any(
                full.startswith(p + ".") for p in children):
            raise ValueError(
                f"{full!r} ({type(sub).__name__}) inside the multi-head latent attention module {name!r} has "
                "parameters the tensor-parallel plan does not place; nxd_hf cannot tell whether it reads the "
                "sharded heads. Use tensor_parallel_size=1, or "
                "register a hand-written patch with nxd_hf.register_patch")
