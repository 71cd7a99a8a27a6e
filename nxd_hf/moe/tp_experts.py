"""HF's fused experts sharded over tensor parallelism (HF's "moe_tp_experts").

Every expert's intermediate dimension is split like a dense MLP's: ``gate_up_proj``
``[E, 2I, H]`` by rows with stride 2 (gate and up halves split separately; an interleaved
``[g0 u0 g1 u1 ...]`` layout, gpt-oss, keeps its pairs with a plain split), ``down_proj``
``[E, H, I]`` by its input columns; the transposed layouts (``[E, H, 2I]``, ``[E, I, H]``)
likewise. HF's own experts ``forward`` runs unchanged on the local slices; around it the
floating inputs (hidden states, top-k weights) enter the TP region (all-reduce backward: each
rank's gradient is partial) and the output, a partial sum over the ranks, is all-reduced.
A down-projection bias (gpt-oss) is added on TP rank 0 only, so the sum holds it once; an
identity expert (LongCat) likewise.

The router and everything else in the MoE block (the experts' parent) stay replicated and see
every token, so the router logits HF records for the aux loss are whole on every rank. Under
sequence parallelism the block gathers the sequence on entry (backward: keep this rank's
chunk) and splits its output again (backward: all-gather), so inside it all ranks compute
like at tp>1 without SP; its replicated parameters then have whole (not partial) gradients.
"""

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers import mappings
from nxd_hf.parallel_layers.sharding import (
    contiguous_shard_index, mark_partial_grad_over_tp, set_tensor_model_parallel_attributes, shard_from_full,
)

# (transposed, concatenated) of experts modules without HF's ``use_experts_implementation``
# attributes: Llama 4's ``bmm`` experts hold ``[E, H, 2I]`` / ``[E, I, H]``; LongCat's loop ones
# ``[E, 2I, H]`` / ``[E, H, I]`` (plus identity experts).
KNOWN_LAYOUTS = {"Llama4TextExperts": (True, True), "LongcatFlashExperts": (False, True)}
ONCE_OVER_TP = ("down_proj_bias",)  # added to the partial sum: kept on rank 0 only
IDENTITY_EXPERTS = ("identity_expert",)


def _layout(name: str, module: nn.Module) -> tuple[bool, bool]:
    if hasattr(module, "is_transposed") and hasattr(module, "is_concatenated"):
        return bool(module.is_transposed), bool(module.is_concatenated)
    if type(module).__name__ in KNOWN_LAYOUTS:
        return KNOWN_LAYOUTS[type(module).__name__]
    raise ValueError(
        f"{name!r}: nxd_hf cannot tell how the experts module {type(module).__name__} lays out its weights (it "
        "lacks HF's use_experts_implementation attributes is_transposed/is_concatenated); use "
        "tensor_parallel_size=1 for it, or register a hand-written patch"
    )


def expert_sharding(name: str, module: nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (partition dim, stride)} of ``module``'s TP-sharded parameters; the rest
    must be in ``ONCE_OVER_TP``."""
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            f"{name!r}: a norm after each expert (has_post_expert_norm) is not linear in the expert's intermediate "
            "units, so the experts cannot be sharded over TP; use tensor_parallel_size=1 for this model"
        )
    transposed, concatenated = _layout(name, module)
    column, row = (2, 1) if transposed else (1, 2)
    stride = 2 if concatenated and getattr(module, "has_gate", True) else 1
    specs = {}
    for p_name, _ in module.named_parameters(recurse=False):
        if p_name in ("gate_up_proj", "up_proj"):
            specs[p_name] = (column, stride if p_name == "gate_up_proj" else 1)
        elif p_name in ("gate_up_proj_bias", "up_proj_bias"):
            specs[p_name] = (1, stride if p_name == "gate_up_proj_bias" else 1)
        elif p_name == "down_proj":
            specs[p_name] = (row, 1)
        elif p_name not in ONCE_OVER_TP:
            raise ValueError(
                f"{name}.{p_name}: nxd_hf does not know how this parameter of {type(module).__name__} is sharded "
                "over TP; use tensor_parallel_size=1, or register a hand-written patch"
            )
    if [n for n, _ in module.named_children() if n not in IDENTITY_EXPERTS and list(_.parameters())]:
        raise ValueError(f"{name!r}: an experts module with sub-modules holding parameters is not supported at tp > 1")
    return specs


def _check_divisible(name: str, module: nn.Module, specs: dict, tp: int) -> None:
    for p_name, (dim, stride) in specs.items():
        size = getattr(module, p_name).shape[dim]
        if size % (stride * tp) != 0:
            raise ValueError(
                f"{name}.{p_name}: the experts' intermediate size ({size // stride}) must be divisible by the "
                f"tensor parallel size ({tp}) to shard the experts; use a tensor_parallel_size dividing it"
            )


def shard_experts(name: str, module: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Replace ``module``'s expert weights with this rank's slices (meta stays meta), wrap its
    forward in the TP region; returns the (old, new) parameters."""
    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    specs = expert_sharding(name, module)
    _check_divisible(name, module, specs, tp)
    swapped = []
    for p_name, (dim, stride) in specs.items():
        old = getattr(module, p_name)
        index = contiguous_shard_index(old.shape[dim], rank, tp, stride)
        if old.is_meta:
            shape = list(old.shape)
            shape[dim] = len(index)
            data = torch.empty(shape, dtype=old.dtype, device="meta")
        else:
            data = shard_from_full(old.detach(), dim, index)
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        set_tensor_model_parallel_attributes(new, partition_dim=dim, logical_size=old.shape[dim], shard_index=index,
                                             stride=stride)
        setattr(module, p_name, new)
        swapped.append((old, new))
    for p_name in ONCE_OVER_TP:
        if getattr(module, p_name, None) is not None:
            mark_partial_grad_over_tp(getattr(module, p_name))  # nonzero on rank 0 only: summed over TP
    if any(getattr(module, p, None) is not None for p in ONCE_OVER_TP):
        module.__class__ = _once_over_tp_class(type(module))
    for child in IDENTITY_EXPERTS:
        if isinstance(getattr(module, child, None), nn.Identity):
            setattr(module, child, OnceOverTP())
    module.register_forward_pre_hook(_enter_experts, with_kwargs=True)
    module.register_forward_hook(_leave_experts)
    return swapped


def _enter(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return mappings.copy_to_tensor_model_parallel_region(value)
    return value


def _enter_experts(module, args, kwargs):
    """Hidden states and top-k weights enter the TP region (their gradients are partial per rank)."""
    return tuple(_enter(a) for a in args), {k: _enter(v) for k, v in kwargs.items()}


def _leave_experts(module, args, output):
    """The experts' output is a partial sum over the ranks' intermediate slices."""
    if isinstance(output, tuple):
        return (mappings.reduce_from_tensor_model_parallel_region(output[0]), *output[1:])
    return mappings.reduce_from_tensor_model_parallel_region(output)


def _rank_zero_scale(like: torch.Tensor) -> torch.Tensor:
    return like * float(parallel_state.get_tensor_model_parallel_rank() == 0)


class OnceOverTP(nn.Module):
    """An identity expert inside the TP region: its output counts on TP rank 0 only, so the sum
    over the ranks holds it once (and its input gradient once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rank_zero_scale(x)


_ONCE_CLASSES: dict[type, type] = {}


def _once_over_tp_class(cls: type) -> type:
    """``cls`` whose ``ONCE_OVER_TP`` parameters read as zero on TP ranks other than 0 (the
    stored parameter, its name and its state-dict entry stay the same)."""
    if cls not in _ONCE_CLASSES:
        def __getattr__(self, name):
            value = cls.__getattr__(self, name)
            return _rank_zero_scale(value) if name in ONCE_OVER_TP and value is not None else value

        _ONCE_CLASSES[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__})
    return _ONCE_CLASSES[cls]


def _gather_sequence(x):
    return mappings.gather_from_sequence_parallel_region(x, to_model_parallel=False).contiguous()  # HF views it


def _enter_block(module, args, kwargs):
    """Under SP: the MoE block sees the whole sequence (backward keeps this rank's chunk)."""
    x = _gather_sequence(args[0] if args else kwargs["hidden_states"])
    module._nxd_sequence_shape = x.shape
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _split_sequence(module, y: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the block's output, which may come flattened to ``[tokens, h]`` (Llama 4)."""
    batch, seq = module._nxd_sequence_shape[:2]
    if y.dim() == 2 and y.shape[0] == batch * seq:
        return mappings.scatter_to_sequence_parallel_region(y.view(batch, seq, -1)).reshape(-1, y.shape[-1])
    return mappings.scatter_to_sequence_parallel_region(y)


def _leave_block(module, args, kwargs, output):
    """Under SP: back to this rank's chunk of the sequence (backward all-gathers)."""
    if isinstance(output, tuple):
        return (_split_sequence(module, output[0]), *output[1:])
    return _split_sequence(module, output)


def install_block_sequence_parallel(block: nn.Module) -> None:
    block.register_forward_pre_hook(_enter_block, with_kwargs=True)
    block.register_forward_hook(_leave_block, with_kwargs=True)
