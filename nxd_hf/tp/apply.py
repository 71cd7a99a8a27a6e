"""Apply a ``ModelPatch``: swap an HF model's modules for parallel layers, in place.

Parallel layers are built on the meta device; when the original module holds real weights,
this rank's slice is copied from them, so a real model ends up sharded and a meta model stays
meta (to be filled from files by ``nxd_hf.checkpoint.hf_safetensors``).
"""

import copy
import re

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear, mappings
from nxd_hf.parallel_layers.layers import set_local_
from nxd_hf.parallel_layers.sharding import (
    is_sharded, local_shard, mark_partial_grad_over_tp, set_tensor_model_parallel_attributes, shard_from_full,
)
from nxd_hf.parallel_layers.heads import HeadLayout
from nxd_hf.tp import plan
from nxd_hf.moe.tp_experts import install_block_sequence_parallel, shard_experts
from nxd_hf.tp.derive import check_shardable
from nxd_hf.tp.custom_modules import build_embedding, check_experts, check_kept
from nxd_hf.tp.layouts import module_layout
from nxd_hf.tp.mla import LatentAttention, check_latent_attention
from nxd_hf.tp.region_parameters import mark_region_parameters


def base_prefix(model: nn.Module, patch: plan.ModelPatch) -> str:
    """The attribute holding the base model, that the plan's names are relative to. A task model
    whose HF ``base_model_prefix`` names no attribute of it (``Llama4ForCausalLM``: "language_model",
    its base model at ``.model``) has it in the child model sharing its config."""
    prefix = patch.base_model_prefix if patch.base_model_prefix is not None else model.base_model_prefix
    if prefix and not hasattr(model, prefix):
        config = getattr(model, "config", None)
        return next((name for name, child in model.named_children() if getattr(child, "config", None) is config
                     and config is not None), prefix)
    return prefix


def _pattern(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def match_plan(patch: plan.ModelPatch, model: nn.Module) -> list[tuple[str, nn.Module, plan.Style]]:
    """(full name, module, style) for every module of ``model`` a plan entry names."""
    prefix = base_prefix(model, patch)
    compiled = [(_pattern(p), style) for p, style in patch.plan.items()]
    found = []
    for name, module in model.named_modules():
        relative = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        for regex, style in compiled:
            if regex.fullmatch(relative):
                found.append((name, module, style))
                break
        if patch.lm_head and name == patch.lm_head:
            found.append((name, module, plan.LMHead()))
    return found


def _linear_shape(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, is_conv1d) of an nn.Linear or HF Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D":
        return module.weight.shape[0], module.weight.shape[1], True
    raise ValueError(f"cannot shard {type(module).__name__}: a plan's Column/Row entry must name an nn.Linear or Conv1D")


def _copy_sharded(new: nn.Module, old: nn.Module, transposed: bool) -> None:
    """Fill ``new``'s parameters with this rank's slice of ``old``'s real weights."""
    for name in ("weight", "bias"):
        param, source = getattr(new, name, None), getattr(old, name, None)
        if param is None or source is None:
            continue
        param.hf_transposed = transposed and name == "weight"
        if source.is_meta:
            continue
        full = source.detach().t() if param.hf_transposed else source.detach()
        local = local_shard(param, full)
        set_local_(new, name, local)


def _build(module: nn.Module, style: plan.Style, layout: HeadLayout | None, sp: bool, in_region: bool) -> nn.Module:
    dtype = next(module.parameters()).dtype
    if isinstance(style, plan.Embedding):  # full-sequence output: SP starts at the first decoder layer
        return build_embedding(module, dtype)
    in_features, out_features, conv1d = _linear_shape(module)
    bias = module.bias is not None
    if isinstance(style, plan.LMHead):  # after the decoder layers: full sequence
        return ColumnParallelLinear(in_features, out_features, bias, gather_output=False, dtype=dtype, device="meta")
    heads = style.heads
    if heads == "q" and isinstance(style, plan.Column) and out_features == 2 * layout.num_heads * layout.head_dim:
        heads = "q_gated"  # the query and its output gate, per head
    if heads == "head_blocks":  # multi-head latent attention (nxd_hf.tp.mla)
        rows, replicas = layout.head_blocks(out_features if isinstance(style, plan.Column) else in_features), 1
    else:
        rows, replicas = layout.rows(heads) if heads else (None, 1)
    if isinstance(style, plan.Column):
        return ColumnParallelLinear(
            in_features, out_features, bias, gather_output=style.gather_output, sequence_parallel_enabled=sp,
            dtype=dtype, device="meta", stride=style.stride, shard_index=rows, num_replicas=replicas,
            skip_input_collective=in_region,
        )
    return RowParallelLinear(
        in_features, out_features, bias, input_is_parallel=style.input_is_parallel,
        sequence_parallel_enabled=sp and style.input_is_parallel, dtype=dtype, device="meta", shard_index=rows,
    )


def _attention_layouts(matched, layout: HeadLayout | None) -> dict[str, HeadLayout]:
    """Each attention module's own layout (its head_dim and K/V heads may differ per layer)."""
    layouts = {}
    for name, module, style in matched:
        if isinstance(style, plan.Attention) and layout is not None:
            kv = next((m for n, m, s in matched if n.startswith(name + ".") and getattr(s, "heads", None) == "kv"), None)
            layouts[name] = module_layout(module, kv, layout)
    return layouts


def _layout_of(name: str, layouts: dict[str, HeadLayout], default: HeadLayout | None) -> HeadLayout | None:
    return next((lay for attention, lay in layouts.items() if name.startswith(attention + ".")), default)


def _shard_head_parameters(model: nn.Module, patch: plan.ModelPatch, layouts: dict[str, HeadLayout]) -> None:
    """A colwise plan entry naming a bare parameter of an attention module with one value per
    query head (attention sinks, ``[num_heads]``): keep this rank's heads (0 for padding heads)."""
    prefix = base_prefix(model, patch)
    columns = [_pattern(p) for p, style in patch.plan.items() if isinstance(style, plan.Column)]
    for name, param in list(model.named_parameters()):
        relative = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
        if not any(regex.fullmatch(relative) for regex in columns):
            continue
        layout = _layout_of(name, layouts, None)
        if layout is None or param.dim() != 1 or param.shape[0] != layout.num_heads:
            raise ValueError(
                f"the plan shards parameter {name!r} colwise; nxd_hf shards a bare parameter only when it holds "
                "one value per query head of a sharded attention module. Register a hand-written patch"
            )
        heads = layout.local_heads()
        local = nn.Parameter(shard_from_full(param.detach(), 0, heads), requires_grad=param.requires_grad)
        set_tensor_model_parallel_attributes(local, partition_dim=0, logical_size=layout.num_heads, shard_index=heads)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, local)


def _keep_replicated_attention(name: str, sequence_parallel: bool) -> None:
    """An attention module the plan's projections do not reach (MiniMax's lightning-attention
    layers) runs whole on every rank; under SP it would see one chunk of the sequence."""
    if sequence_parallel:
        raise ValueError(
            f"{name!r} is an attention module none of whose projections the plan shards (e.g. a linear-attention "
            "layer); it stays replicated, which sequence parallelism cannot split. Use sequence_parallel=False"
        )


def _set_local_attrs(module: nn.Module, style: plan.Attention, layout: HeadLayout) -> None:
    for path, quantity in style.attrs:
        target, *rest = path.split(".")
        if rest:  # an attribute of the module's config: give the module its own copy
            if not getattr(module, "_nxd_local_config", False):
                module.config = copy.copy(module.config)
                module._nxd_local_config = True
            setattr(module.config, rest[0], layout.local[quantity])
        elif hasattr(module, target):
            setattr(module, target, layout.local[quantity])


def _first_layer_hook(module, args, kwargs):
    """Split the hidden states along the sequence on entry to the first decoder layer."""
    if args:
        return (mappings.scatter_to_sequence_parallel_region(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": mappings.scatter_to_sequence_parallel_region(kwargs["hidden_states"])}


def _last_layer_hook(module, args, kwargs, output):
    """Gather the sequence after the last decoder layer (split backward)."""
    if isinstance(output, tuple):
        return (mappings.gather_from_sequence_parallel_region(output[0], to_model_parallel=False), *output[1:])
    return mappings.gather_from_sequence_parallel_region(output, to_model_parallel=False)


def _install_sequence_parallel(model: nn.Module, patch: plan.ModelPatch, moe_blocks: list[str]) -> None:
    """Bracket the decoder layers with the SP split/gather; their replicated parameters
    (norms, row-parallel biases) now see one sequence chunk, so their grads are partial.
    A MoE block sees the whole sequence (``nxd_hf.moe.tp_experts``): its parameters are whole."""
    prefix = base_prefix(model, patch)
    layers = model.get_submodule(f"{prefix}.{patch.decoder_layers}" if prefix else patch.decoder_layers)
    layers[0].register_forward_pre_hook(_first_layer_hook, with_kwargs=True)
    layers[len(layers) - 1].register_forward_hook(_last_layer_hook, with_kwargs=True)
    whole = set()
    for block_name in moe_blocks:
        block = model.get_submodule(block_name)
        if any(block is layer for layer in layers):
            raise ValueError(
                f"{block_name!r}: the decoder layer itself calls the router and experts; nxd_hf gathers the sequence "
                "around a MoE block under sequence parallelism and cannot do so here. Use sequence_parallel=False"
            )
        install_block_sequence_parallel(block)
        whole.update(id(p) for p in block.parameters())
    for p in layers.parameters():
        if not is_sharded(p) and id(p) not in whole:
            mark_partial_grad_over_tp(p)


def _enter_region_hook(sequence_parallel: bool):
    """Forward pre-hook: the module's hidden states (first positional or ``hidden_states``)
    enter the tensor-parallel region once."""
    def enter(x):
        if sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, to_model_parallel=True)  # [b, s, h]
        return mappings.copy_to_tensor_model_parallel_region(x)

    def hook(module, args, kwargs):
        if args:
            return (enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}

    return hook


def _retie(model: nn.Module, swapped: dict[int, nn.Parameter]) -> None:
    """Point every remaining reference to a swapped-out parameter at its replacement, keeping
    HF's ties (BERT's ``cls.predictions.bias`` is ``cls.predictions.decoder.bias``)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in swapped:
                module._parameters[name] = swapped[id(param)]


def apply_tensor_parallel(model: nn.Module, patch: plan.ModelPatch, layout: HeadLayout | None, *, sequence_parallel: bool) -> None:
    """Swap every planned module of ``model`` (in place) and mark partial-gradient parameters."""
    if parallel_state.get_tensor_model_parallel_size() > 1 and getattr(model, "config", None) is not None:
        check_shardable(model.config, parallel_state.get_tensor_model_parallel_size())
    embedding, swapped, alive = None, {}, []  # swapped: id(old param) -> new; `matched` keeps the old ones alive
    matched = match_plan(patch, model)
    regions = [name + "." for name, _, style in matched if isinstance(style, plan.ParallelRegion)]
    layouts = _attention_layouts(matched, layout)
    # A MoE block (the experts' parent) is no TP region: its router is replicated.
    moe_blocks = [name.rpartition(".")[0] for name, _, style in matched if isinstance(style, plan.Experts)]
    for name, module, style in matched:
        sp = sequence_parallel and not any(name.startswith(block + ".") for block in moe_blocks)
        if isinstance(style, plan.Attention) and not any(n.startswith(name + ".") for n, _, _ in matched):
            _keep_replicated_attention(name, sequence_parallel)  # none of its projections is planned
            continue
        if isinstance(style, plan.ParallelRegion):
            if name not in moe_blocks and parallel_state.get_tensor_model_parallel_size() > 1:  # else no collective
                module.register_forward_pre_hook(_enter_region_hook(sp), with_kwargs=True)
            if isinstance(style, plan.Attention):
                _set_local_attrs(module, style, layouts[name])
            if isinstance(style, LatentAttention):
                check_latent_attention(name, module, {n for n, _, _ in matched})
        elif isinstance(style, plan.Experts):
            check_experts(name, module, model.get_submodule(name.rpartition(".")[0]))
            if parallel_state.get_tensor_model_parallel_size() > 1:
                for old, new in shard_experts(name, module):
                    swapped[id(old)] = new
                    alive.append(old)  # ids stay unique until _retie
        elif isinstance(style, plan.PerHeadNorm):
            for p in module.parameters():
                mark_partial_grad_over_tp(p)  # partial over heads: summed over TP
        else:
            in_region = any(name.startswith(r) for r in regions)
            check_kept(name, module, style)
            new = _build(module, style, _layout_of(name, layouts, layout), sp, in_region)
            tied = (isinstance(style, (plan.LMHead, plan.Column)) and embedding is not None
                    and module.weight is embedding[0].weight)
            _copy_sharded(new, module, transposed=type(module).__name__ == "Conv1D")
            if tied:  # same vocab rows as the embedding (BERT's MLM decoder is a Column)
                assert torch.equal(new.weight.shard_index, embedding[1].weight.shard_index)
                new.weight = embedding[1].weight  # one parameter, gradients from both uses
            if isinstance(style, plan.Embedding):
                embedding = (module, new)
            swapped.update({id(getattr(module, n)): getattr(new, n) for n in ("weight", "bias")
                            if getattr(module, n, None) is not None and getattr(new, n, None) is not None})
            model.set_submodule(name, new)
    _retie(model, swapped)
    _shard_head_parameters(model, patch, layouts)
    mlp_regions = [name for name, _, style in matched if type(style) is plan.ParallelRegion and name not in moe_blocks and any(
        n.startswith(name + ".") and isinstance(s, plan.Column) and not s.gather_output for n, _, s in matched)]
    mark_region_parameters(model, mlp_regions, {id(p) for p in swapped.values()})
    if patch.after_swap is not None:
        patch.after_swap(model)
    if sequence_parallel:
        _install_sequence_parallel(model, patch, moe_blocks if parallel_state.get_tensor_model_parallel_size() > 1 else [])
