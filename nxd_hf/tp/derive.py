"""A ``ModelPatch`` derived from HF's ``config.base_model_tp_plan``, for architectures without a
hand-written one in ``nxd_hf/model_patches/``.

HF's plan names only the sharded linears. The rest is inferred from module names: a colwise
projection named like a query (``q_proj``, ``query``) or key/value shards by query or K/V heads
and makes its parent the attention module (whose head counts change per rank, and whose rowwise
child is the output projection, sharded by query heads); the parent of the other colwise layers
is a ``ParallelRegion`` (the MLP); ``embed_tokens`` becomes a vocab-parallel embedding; the
``X.*`` prefix of the entries is the decoder-layer list.
"""

from nxd_hf.tp import mla
from nxd_hf.tp.plan import Attention, Column, Embedding, Experts, ModelPatch, ParallelRegion, PerHeadNorm, Row

Q_PROJECTIONS = {"q_proj", "query", "q_gate_proj"}  # q_gate_proj: each query head's block followed by its gate's
KV_PROJECTIONS = {"k_proj", "v_proj", "key", "value"}

# Head-count attributes an attention module may read; set to local values where present.
ATTENTION_ATTRS = (
    ("num_key_value_groups", "num_kv_groups"), ("num_heads", "num_heads"), ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"), ("num_kv_heads", "num_kv_heads"),
)

# Config flags that add q/k norms a plan may not name: e.g. Cohere's use_qk_norm holds one
# weight row per head over all heads, Phi's qk_layernorm a head_dim norm with partial grads.
QK_NORM_FLAGS = ("use_qk_norm", "qk_layernorm")
# Model types whose q/k norm has no weight (Llama 4's L2 norm per head): exact on the local heads.
WEIGHTLESS_QK_NORMS = {"llama4_text"}

# Our SP already covers decoder layers; "local_params" marks a module whose own parameters
# have entries of their own (attention sinks: colwise, sharded by heads in ``nxd_hf.tp.apply``).
_NO_MODULE_CHANGE = {"sequence_parallel", "replicate", "local_params"}
_UNSUPPORTED = {
    "packed_rowwise", "embedding_colwise", "all_reduce", "moe_identity_expert",
    "ep_dispatch_experts",
}

_DENSE = "Closest supported: the dense variant of the family (e.g. Qwen3 for Qwen3-MoE, Mistral for Mixtral). "
_UNSUPPORTED_CONSTRUCTS = {
    "ep_dispatch_experts": ("a mixture-of-experts layer with expert parallelism", _DENSE),
    "moe_identity_expert": ("a mixture-of-experts layer with identity experts", _DENSE),
    "packed_rowwise": ("a row-parallel layer over packed experts", _DENSE),
    "all_reduce": ("a module whose own output HF all-reduces (Inkling's shared experts, fused as 3-D tensors with "
                   "per-token gammas, which nxd_hf does not shard)", "Use tensor_parallel_size=1 for it. "),
}


def _split(pattern: str) -> tuple[str, str]:
    parent, _, leaf = pattern.rpartition(".")
    return parent, leaf


def _base_style(hf_style: str) -> str:
    """HF's "local_X" variants (no DTensor wrapping) shard like "X"; its "unit_colwise" (whole heads
    per rank, replicated where the heads are fewer than the ranks) is how nxd_hf's head layout
    shards any colwise K/V projection."""
    if hf_style.startswith("local_") and hf_style != "local_params":
        return hf_style[len("local_"):]
    return "colwise" if hf_style == "unit_colwise" else hf_style


def _colwise(parent: str, leaf: str, q_parents: set[str]) -> Column:
    if leaf in Q_PROJECTIONS or leaf in KV_PROJECTIONS:
        return Column(heads="q" if leaf in Q_PROJECTIONS else "kv")
    # another projection of an attention module (an output gate: HRM's gate_proj, Laguna's g_proj)
    # has one block per query head, padded heads included
    return Column(heads="head_blocks" if parent in q_parents else None)


def _rowwise(parent: str, leaf: str, q_parents: set[str]) -> Row:
    return Row(heads="q" if parent in q_parents else None)


# HF style (after ``_base_style``) -> our style for one entry, from the entry's parent module,
# its leaf name and the attention modules; None: nothing to change.
_STYLES = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    **dict.fromkeys(("colwise_rep", "colwise_gather_output", "gather"), lambda *_: Column(gather_output=True)),
    **dict.fromkeys(("rowwise_rep", "rowwise_split_input"), lambda *_: Row(input_is_parallel=False)),
    "packed_colwise": lambda *_: Column(stride=2),
    "replicated_with_grad_allreduce": lambda *_: PerHeadNorm(),
    "embedding_rowwise": lambda *_: Embedding(),
    "moe_tp_experts": lambda *_: Experts(),
    **dict.fromkeys(_NO_MODULE_CHANGE, lambda *_: None),
}


def _style(pattern: str, hf_style: str, q_parents: set[str]):
    """Our style for one HF plan entry (None: nothing to change)."""
    parent, leaf = _split(pattern)
    style = _base_style(hf_style)
    if style in _STYLES:
        return _STYLES[style](parent, leaf, q_parents)
    if style in _UNSUPPORTED:
        construct, alternative = _UNSUPPORTED_CONSTRUCTS.get(style, (f"HF tensor-parallel style {hf_style!r}", ""))
        raise ValueError(
            f"{pattern!r}: {construct} (HF tensor-parallel style {hf_style!r}) is not supported by nxd_hf yet. "
            f"{alternative}Or register a hand-written patch with "
            "nxd_hf.register_patch(nxd_hf.tp.ModelPatch(model_type=..., plan={...}))"
        )
    raise ValueError(f"{pattern!r}: unknown HF tensor-parallel style {hf_style!r} in base_model_tp_plan")


DEFAULT_DECODER_LAYERS = "layers"


def _decoder_layers(model_type: str, hf_plan: dict[str, str]) -> tuple[str, int]:
    """(the decoder-layer list, how many layer stacks the plan names). Several stacks (HRM's
    ``H_module.layers`` and ``L_module.layers``, each run several times per step) shard alike;
    only SP, which splits the sequence on entry to one list and gathers after it, needs one."""
    prefixes = {p.split(".*.", 1)[0] for p in hf_plan if ".*." in p}
    if not prefixes:  # a plan sharding nothing per layer (the embedding only): HF's own name for the list,
        return DEFAULT_DECODER_LAYERS, 1  # checked against the model when the patch is applied
    return sorted(prefixes)[0], len(prefixes)


def _attention_modules(hf_plan: dict[str, str]) -> set[str]:
    """Parents of head-sharded q projections (a gathered one keeps every head on each rank)."""
    parents = {_split(p)[0] for p, s in hf_plan.items() if _split(p)[1] in Q_PROJECTIONS and _base_style(s) == "colwise"}
    for parent in parents:
        rows = [p for p, s in hf_plan.items() if _split(p)[0] == parent and _base_style(s) == "rowwise"]
        if len(rows) > 1:  # only the output projection reads query heads
            raise ValueError(
                f"attention module {parent!r} has several rowwise layers {rows}: nxd_hf shards the input of the "
                "attention output projection by query heads, but another rowwise layer reads something else (as "
                "Doge's dt_proj reads the value heads: nxd_hf/model_patches/doge.py) and cannot be split the same way. Closest supported: "
                "tensor_parallel_size=1 for this architecture, or a hand-written patch with nxd_hf.register_patch"
            )
    return parents


# Config fields whose model code cannot run on a TP shard as derived -> why (and what to do).
_UNSHARDABLE_CONFIG = {
    "unpadded_vocab_size": (lambda v: v is not None, "the model slices its logits to config.unpadded_vocab_size, which would cut this "
                           "rank's vocab-parallel shard of them (Inkling 2)"),
    "gating": (lambda v: v is True or v == "per-head", "the attention output gate g_proj has one row per query "
               "head, which nxd_hf does not shard by heads yet (Laguna)"),
}


# Model types whose attention code fixes a layout of its fused projection: (the TP sizes it
# shards exactly at, from the config and tp) -> why.
_FIXED_LAYOUTS = {
    # CodeGen splits qkv_proj's columns into 4 blocks of [q; v; k] (the 4-way model parallelism it was
    # trained with): a rank's columns are whole blocks of whole heads only when tp divides 4 and the heads
    "codegen": (lambda config, tp: 4 % tp == 0 and config.num_attention_heads % tp == 0,
                "its attention splits the fused qkv_proj into 4 interleaved [q; v; k] blocks, which a rank holds "
                "whole only when tensor_parallel_size divides 4 and num_attention_heads (no head padding)"),
}


def check_shardable(config, tp_size: int) -> None:
    """ValueError at tp > 1 for config features whose model code cannot run on a TP shard."""
    for field, (applies, why) in _UNSHARDABLE_CONFIG.items():
        if hasattr(config, field) and applies(getattr(config, field)):
            raise ValueError(f"{config.model_type!r}: {why}. Use tensor_parallel_size=1 for this architecture, or "
                             "a hand-written patch with nxd_hf.register_patch")
    fits, why = _FIXED_LAYOUTS.get(getattr(config, "model_type", None), (lambda *_: True, ""))
    if not fits(config, tp_size):
        raise ValueError(f"{config.model_type!r} at tensor_parallel_size={tp_size}: {why}. Use a tensor_parallel_size "
                         "that does, or a hand-written patch with nxd_hf.register_patch")


def _check_config(model_type: str, hf_plan: dict[str, str], config) -> None:
    per_layer = getattr(config, "num_attention_heads_per_layer", None)
    if per_layer and any(n != config.num_attention_heads for n in per_layer):
        raise ValueError(
            f"{model_type!r}: config.num_attention_heads_per_layer {list(per_layer)} differs from "
            f"config.num_attention_heads={config.num_attention_heads}, which nxd_hf's head layout reads for every "
            "layer (Laguna): give every layer config.num_attention_heads heads, or register a hand-written patch "
            "with nxd_hf.register_patch"
        )
    names_norms = any(_base_style(s) == "replicated_with_grad_allreduce" for s in hf_plan.values())
    for flag in QK_NORM_FLAGS:
        if getattr(config, flag, False) and not names_norms and model_type not in WEIGHTLESS_QK_NORMS:
            raise ValueError(
                f"config.{flag}=True adds q/k norms that {model_type!r}'s base_model_tp_plan does not shard; "
                f"set {flag}=False, or register a hand-written patch with nxd_hf.register_patch"
            )


def _with_ep_plan_experts(hf_plan: dict[str, str], config) -> dict[str, str]:
    """``hf_plan`` plus a "moe_tp_experts" entry for each fused experts module only the config's
    ``base_model_ep_plan`` names ("ep_dispatch_experts"): transformers 5.25 took the experts out of
    its tensor-parallel plans; nxd_hf still shards them over TP (``nxd_hf.moe.tp_experts``)."""
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    implied = {p: "moe_tp_experts" for p, s in ep_plan.items() if s == "ep_dispatch_experts" and p not in hf_plan}
    return {**hf_plan, **implied}


def patch_from_hf_plan(model_type: str, hf_plan: dict[str, str], *, config=None) -> ModelPatch:
    """A ``ModelPatch`` for ``model_type`` from its HF ``base_model_tp_plan`` (see module doc).
    ``config``, when given, is checked for features the plan does not cover."""
    if config is not None:
        hf_plan = _with_ep_plan_experts(hf_plan, config)
        _check_config(model_type, hf_plan, config)
    decoder_layers, stacks = _decoder_layers(model_type, hf_plan)
    hf_plan = mla.with_implied_entries(hf_plan, decoder_layers, config)
    latent = mla.latent_parents(hf_plan)
    q_parents = _attention_modules({p: s for p, s in hf_plan.items() if _split(p)[0] not in latent})
    plan = {"embed_tokens": Embedding(), **mla.latent_plan(hf_plan, latent)}
    plan.update({parent: Attention(attrs=ATTENTION_ATTRS) for parent in sorted(q_parents)})
    experts = {p for p, s in hf_plan.items() if _base_style(s) == "moe_tp_experts"}
    for pattern, hf_style in hf_plan.items():
        if _split(pattern)[0] in experts:
            continue  # a 3-D parameter of a fused experts module: part of its Experts style
        if pattern in latent or _split(pattern)[0] in latent:
            continue  # planned by mla.latent_plan
        style = _style(pattern, hf_style, q_parents)
        if style is None:
            if pattern not in q_parents:  # an attention module stays one ("local_params")
                plan.pop(pattern, None)
            continue
        parent = _split(pattern)[0]
        if (isinstance(style, Column) and not style.gather_output and parent not in q_parents
                and parent not in ("", f"{decoder_layers}.*")):
            plan.setdefault(parent, ParallelRegion())  # one input collective for the MLP's column layers
            # (a gathered column keeps its own: its input may be computed inside the module, Qwen3.5's
            # linear attention out_proj)
        plan[pattern] = style
    # A gathered output (or split input) is full-sequence under SP, where the residual stream is
    # split, and replicated params after it see full data: no SP for such plans (OLMo-2).
    # Nor when the plan leaves attention replicated (no sharded q projection: YoutU): it would see one
    # chunk of the sequence.
    gathered = any(isinstance(s, (Column, Row)) and not _splits_sequence(s) for s in plan.values())
    # Per-layer inputs (Gemma 4's PLE) are whole-sequence tensors every decoder layer multiplies in.
    gathered = gathered or bool(getattr(config, "hidden_size_per_layer_input", 0))
    return ModelPatch(model_type=model_type, plan=plan, decoder_layers=decoder_layers,
                      sequence_parallel=not gathered and bool(q_parents or latent) and stacks == 1,
                      pipeline_refusal=None if stacks == 1 else "its decoder is several layer stacks run in cycles, "
                      "not one list of layers to cut into stages",
                      num_kv_heads_attr=None if latent else "num_key_value_heads")  # MLA: K/V per query head


def _splits_sequence(style: Column | Row) -> bool:
    return not style.gather_output if isinstance(style, Column) else style.input_is_parallel
