"""What the plan knows of a model: its dimensions from the config, and the parameters each rank
holds for a (tp, ep) layout, counted by nxd_hf's own sharding rules on a meta-device model.

The model is built once on the meta device (no memory, any size). Its modules are matched
against the architecture's tensor-parallel plan (``nxd_hf.tp.apply.match_plan``) and every
parameter's local size follows from the same index arithmetic the parallel layers use: vocab
padded to a multiple of tp (``contiguous_shard_index``), query heads padded and K/V heads
replicated when kv_heads < tp (``parallel_layers.heads.head_layout``), fused sub-tensors split
per stride, row-parallel biases and norms replicated; fused experts [E, 2I, H] / [E, H, I] hold
E/ep experts and I/tp of each (the expert-parallel contract).
"""

import dataclasses
import re

import torch
from torch import nn

from nxd_hf.architectures import get_patch
from nxd_hf.parallel_layers.heads import head_layout
from nxd_hf.parallel_layers.sharding import contiguous_shard_index
from nxd_hf.tp import plan as tp_plan
from nxd_hf.tp.apply import match_plan
from nxd_hf.tp.layouts import config_head_dim

PRE, POST = "pre", "post"  # parameters before the first decoder layer (embeddings) and after the last


@dataclasses.dataclass(kw_only=True)
class ModelShape:
    """The dimensions the cost model uses, read from the config and the meta model."""

    model_type: str
    hidden: int  # h
    intermediate: int  # dense MLP width (0 when every layer is MoE)
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads
    head_dim: int
    vocab: int  # unpadded
    num_experts: int = 0  # 0: dense
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0
    """Width of one expert's MLP."""
    moe_layers: int = 0
    """Decoder layers holding fused experts."""
    sequence_parallel: bool = True
    """The architecture's patch allows sequence parallelism."""
    total_params: int = 0
    """Unsharded parameter count (tied weights once)."""
    layer_macs: tuple[int, ...] = ()
    """Per decoder layer, the multiply-adds per token of its weight matrices: every parameter of two
    or more dims (GPT-2's Conv1D, fused projections, routers and shared experts alike), an expert
    tensor ``[E, ...]`` times top_k / E. Counted on the meta model, so no architecture needs a
    rule of its own; empty: the FLOPs come from the dimensions above (a Llama-style layer)."""


@dataclasses.dataclass(kw_only=True)
class RankParams:
    """Parameters one rank holds for one (tp, ep): element counts per place (layer index, PRE, POST)."""

    by_place: dict
    lora_by_place: dict
    tied_embedding: int = 0
    """Elements of the embedding the LM head shares (held twice when they land on different stages)."""
    replicated_by_layer: dict = dataclasses.field(default_factory=dict)
    """Elements of the replicated parameters of each decoder layer (norms, row-parallel biases) but a
    MoE block's: under sequence parallelism they see one chunk, so their gradients are partial over TP."""
    partial_by_layer: dict = dataclasses.field(default_factory=dict)
    """Elements of each decoder layer's replicated parameters whose gradients are partial over TP
    without sequence parallelism too (per-head norms: each rank sees its own heads)."""
    experts_by_layer: dict = dataclasses.field(default_factory=dict)
    """Elements of each decoder layer's local experts (in ``by_place`` too): ZeRO-1 shards them over
    the expert-data group (dp / ep ranks), not the data group."""
    fractions: dict = dataclasses.field(default_factory=dict)
    """Module name -> the share of its output a rank computes, for each column-parallel layer and
    fused expert block: what its sharded activations scale by (``plan.activations``)."""

    def stage(self, layers, *, first: bool, last: bool, lora: bool = False) -> int:
        table = self.lora_by_place if lora else self.by_place
        total = sum(table.get(i, 0) for i in layers)
        total += (table.get(PRE, 0) if first else 0) + (table.get(POST, 0) if last else 0)
        if last and not first and not lora:
            total += self.tied_embedding
        return total


def meta_model(config) -> nn.Module:
    """The causal LM (or base model) of ``config`` on the meta device."""
    import transformers

    with torch.device("meta"):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
    raise ValueError(f"transformers has no model class for model_type {config.model_type!r}")


def _experts(model: nn.Module, patch) -> list[nn.Module]:
    return [m for _, m, style in match_plan(patch, model) if isinstance(style, tp_plan.Experts)]


def model_shape(config, model: nn.Module | None = None) -> ModelShape:
    """The dimensions of ``config`` (``model``: its meta model, built when not given)."""
    text = getattr(config, "get_text_config", lambda: config)()
    model = model if model is not None else meta_model(config)
    patch = get_patch(config)
    num_heads = getattr(text, patch.num_heads_attr)
    num_kv_heads = (getattr(text, patch.num_kv_heads_attr, None) if patch.num_kv_heads_attr else None) or num_heads
    experts = _experts(model, patch)
    num_experts = top_k = expert_intermediate = 0
    if experts:
        gate_up = experts[0].gate_up_proj  # [E, 2I, H] (or [E, H, 2I])
        num_experts = gate_up.shape[0]
        expert_intermediate = next(d for d in gate_up.shape[1:] if d != text.hidden_size) // 2
        top_k = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_top_k", "top_k") if hasattr(text, k)), 1)
    dense = [m for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "down_proj")
             and isinstance(m.down_proj, nn.Linear)]
    expert_params = {id(p): top_k / num_experts for m in experts for p in m.parameters()}
    return ModelShape(
        model_type=config.model_type, hidden=text.hidden_size, num_layers=text.num_hidden_layers,
        intermediate=dense[0].down_proj.in_features if dense else 0,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=config_head_dim(text, num_heads),
        vocab=text.vocab_size, num_experts=num_experts, top_k=top_k, expert_intermediate=expert_intermediate,
        moe_layers=len(experts), sequence_parallel=patch.sequence_parallel,
        total_params=sum(p.numel() for p in model.parameters()),
        layer_macs=tuple(round(sum(p.numel() * expert_params.get(id(p), 1) for p in layer.parameters() if p.dim() >= 2))
                         for layer in decoder_layers(model, patch)))


def decoder_layers(model: nn.Module, patch) -> nn.ModuleList:
    """The decoder layers of ``model`` (an HF causal LM or its peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = patch.base_model_prefix if patch.base_model_prefix is not None else base.base_model_prefix
    root = base.get_submodule(prefix) if prefix and hasattr(base, prefix) else base
    return root.get_submodule(patch.decoder_layers)


def experts_supported(tp: int, pp: int, ep: int, zero_1: bool, num_experts: int) -> str | None:
    """Why nxd_hf refuses fused experts at this layout, or None (experts compose with every tp, pp
    and ZeRO-1; ``nxd_hf.moe.ep_dispatch`` refuses only experts that do not divide over ep)."""
    if ep > 1 and num_experts % ep:
        return f"{num_experts} experts do not divide over ep={ep}"
    return None


def _place(name: str, layers_prefix: str) -> int | str:
    match = re.match(re.escape(layers_prefix) + r"\.(\d+)\.", name)
    if match:
        return int(match.group(1))
    return PRE if "embed" in name or "wte" in name or "wpe" in name else POST


def _linear_local(module: nn.Module, style, layout, tp: int) -> dict[str, int]:
    """Local elements of each parameter of a swapped Column/Row/LMHead/Embedding module."""
    if isinstance(style, tp_plan.Embedding):
        return {"weight": len(contiguous_shard_index(module.num_embeddings, 0, tp)) * module.embedding_dim}
    conv1d = type(module).__name__ == "Conv1D"
    in_f, out_f = (module.weight.shape if conv1d else (module.in_features, module.out_features))
    heads = getattr(style, "heads", None)
    if heads == "q" and isinstance(style, tp_plan.Column) and out_f == 2 * layout.num_heads * layout.head_dim:
        heads = "q_gated"
    if heads:
        rows = len(layout.rows(heads)[0])
    else:
        size = in_f if isinstance(style, tp_plan.Row) else out_f
        rows = len(contiguous_shard_index(size, 0, tp, getattr(style, "stride", 1)))
    has_bias = getattr(module, "bias", None) is not None
    if isinstance(style, tp_plan.Row):
        return {"weight": rows * out_f, **({"bias": out_f} if has_bias else {})}
    return {"weight": rows * in_f, **({"bias": rows} if has_bias else {})}


def _expert_local(param: torch.Tensor, name: str, hidden: int, tp: int, ep: int) -> int:
    """An expert tensor's local elements: dim 0 over ep, its intermediate dim over tp."""
    shape = list(param.shape)
    if shape[0] % ep:
        raise ValueError(f"{shape[0]} experts do not divide over expert_parallel_size={ep}")
    shape[0] //= ep
    if len(shape) == 3 or "gate_up" in name:  # biases of down_proj are [E, hidden]: replicated over tp
        dim = next((d for d in range(1, len(shape)) if shape[d] != hidden), None)
        if dim is not None:
            if shape[dim] % tp:
                raise ValueError(f"expert width {shape[dim]} does not divide over tensor_parallel_size={tp}")
            shape[dim] //= tp
    return int(torch.Size(shape).numel())


def rank_params(config, model: nn.Module, *, tp: int, ep: int = 1, lora_config=None) -> RankParams:
    """Elements of the parameters (and LoRA adapters) rank 0 of a TP group holds, per place.
    Raises ValueError (nxd_hf's own message) when the layout cannot shard this model."""
    patch = get_patch(config)
    text = getattr(config, "get_text_config", lambda: config)()
    prefix = patch.base_model_prefix if patch.base_model_prefix is not None else model.base_model_prefix
    layers_prefix = f"{prefix}.{patch.decoder_layers}" if prefix else patch.decoder_layers
    num_heads = getattr(text, patch.num_heads_attr, None)
    layout = None
    if num_heads is not None:
        if tp > num_heads:
            raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_heads} attention heads")
        kv = (getattr(text, patch.num_kv_heads_attr, None) if patch.num_kv_heads_attr else None) or num_heads
        layout = head_layout(num_heads, kv, config_head_dim(text, num_heads), 0, tp)
    local, swapped, row_biases, moe_blocks, expert_ids, fractions = {}, {}, set(), [], set(), {}
    per_head = set()  # ``tp.apply`` marks their parameters partial over TP at any layout
    for name, module, style in match_plan(patch, model):
        if isinstance(style, (tp_plan.Column, tp_plan.Row, tp_plan.Embedding, tp_plan.LMHead)):
            for pname, numel in _linear_local(module, style, layout, tp).items():
                local[id(getattr(module, pname))] = numel
            swapped[name] = style
            if isinstance(style, tp_plan.Column):
                fractions[name] = local[id(module.weight)] / module.weight.numel()
            if isinstance(style, tp_plan.Row) and getattr(module, "bias", None) is not None:
                row_biases.add(id(module.bias))
        elif isinstance(style, tp_plan.PerHeadNorm):
            per_head.update(id(p) for p in module.parameters())
        elif isinstance(style, tp_plan.Experts):
            moe_blocks.append(name.rpartition(".")[0] + ".")
            fractions[name] = 1 / tp
            for pname, param in module.named_parameters(recurse=False):
                local[id(param)] = _expert_local(param, pname, text.hidden_size, tp, ep)
                expert_ids.add(id(param))
    by_place, replicated, partial, experts, seen = {}, {}, {}, {}, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        place = _place(name, layers_prefix)
        by_place[place] = by_place.get(place, 0) + local.get(id(param), param.numel())
        if id(param) in per_head and isinstance(place, int):
            partial[place] = partial.get(place, 0) + param.numel()
        if id(param) in expert_ids:
            experts[place] = experts.get(place, 0) + local[id(param)]
        if (isinstance(place, int) and (id(param) not in local or id(param) in row_biases)
                and not any(name.startswith(block) for block in moe_blocks)):
            replicated[place] = replicated.get(place, 0) + param.numel()
    tied = _tied_embedding(model, local)
    lora = _lora_params(model, swapped, layout, tp, lora_config, layers_prefix) if lora_config else {}
    return RankParams(by_place=by_place, lora_by_place=lora, tied_embedding=tied, replicated_by_layer=replicated,
                      partial_by_layer=partial, experts_by_layer=experts, fractions=fractions)


def _tied_embedding(model: nn.Module, local: dict) -> int:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is None or inp is None or out.weight is not inp.weight:
        return 0
    return local.get(id(inp.weight), inp.weight.numel())


def _targets(lora_config, model: nn.Module) -> list[str]:
    target = lora_config.target_modules
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if target == "all-linear":
        return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not out]
    if isinstance(target, str):
        return [n for n in names if re.fullmatch(target, n)]
    return [n for n in names if n.split(".")[-1] in set(target) or n in set(target)]


def _lora_params(model, swapped: dict, layout, tp: int, lora_config, layers_prefix: str) -> dict:
    """LoRA A [r, in] and B [out, r] per targeted linear (``nxd_hf.lora.layers``: a column layer's
    B is sharded like its rows, a row layer's A like its columns; the other factor replicated)."""
    r, by_place = lora_config.r, {}
    for name in _targets(lora_config, model):
        module = model.get_submodule(name)
        style = swapped.get(name)
        if isinstance(style, tp_plan.Row):
            numel = _linear_local(module, style, layout, tp)["weight"] // module.out_features * r + module.out_features * r
        elif isinstance(style, (tp_plan.Column, tp_plan.LMHead)):
            numel = module.in_features * r + _linear_local(module, style, layout, tp)["weight"] // module.in_features * r
        else:
            numel = (module.in_features + module.out_features) * r
        place = _place(name + ".", layers_prefix)
        by_place[place] = by_place.get(place, 0) + numel
    return by_place
