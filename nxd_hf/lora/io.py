"""PEFT-format adapters in and out of a parallel model: logical (unsharded, unpadded, HF
layout) tensors in ``adapter_model.safetensors``, this rank's slice in the model.

Adapters are small, so saving gathers each sharded adapter tensor whole on every rank (one
rank writes), and loading reads the file whole on every rank and keeps its slice.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxd_hf import backend
from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.parallel_layers.sharding import TP_ATTRIBUTES, full_tensor, is_sharded, local_shard

_EXTRA_ATTRIBUTES = ("hf_transposed",)
SAVE_ARRIVAL_TIMEOUT_S = 300.0
PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding)


def is_parallel_model(model: nn.Module) -> bool:
    """Whether ``model`` holds nxd_hf parallel layers (then saving and loading go through here)."""
    return any(isinstance(m, PARALLEL_LAYERS) for m in model.modules())


def copy_parallel_metadata(dst: nn.Module, src: nn.Module) -> None:
    """Give ``dst``'s parameters ``src``'s sharding metadata (``copy.deepcopy`` drops it; peft's
    ``modules_to_save`` copies modules that way)."""
    src_params = dict(src.named_parameters())
    for name, param in dst.named_parameters():
        for attr in TP_ATTRIBUTES + _EXTRA_ATTRIBUTES:
            if name in src_params and hasattr(src_params[name], attr):
                setattr(param, attr, getattr(src_params[name], attr))


def logical_tensor(param: torch.Tensor) -> torch.Tensor:
    """The unsharded, unpadded tensor in HF's layout: gathered over the DP ranks when FSDP2
    shards it (ZeRO-2/3), then over TP when TP shards it (collectives every rank joins)."""
    full = full_tensor(param, param.detach().full_tensor() if isinstance(param, DTensor) else None)
    return full.t().contiguous() if getattr(param, "hf_transposed", False) else full


def logical_state_dict(model: nn.Module, keep: set[int]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the tensors whose id is in ``keep`` made logical. Every TP rank
    must call it (same order everywhere: the state dict's)."""
    state = model.state_dict(keep_vars=True)
    return {k: logical_tensor(v) if id(v) in keep else v.detach() for k, v in state.items()}


def _local_value(key: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a logical ``value`` for ``param``; ValueError on a shape mismatch."""
    if getattr(param, "hf_transposed", False) and value.dim() == 2:
        value = value.t()
    if not is_sharded(param):
        logical_shape = tuple(param.shape)
    else:
        logical_shape = list(param.shape)
        logical_shape[param.partition_dim] = param.logical_size
        logical_shape = tuple(logical_shape)
    if tuple(value.shape) != logical_shape:
        raise ValueError(
            f"adapter tensor {key} has shape {tuple(value.shape)} but this model expects {logical_shape} (unsharded): "
            "the adapter was trained for another model or configuration (r, target modules, sizes)"
        )
    return local_shard(param, value)


def localize_hook(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook on the root: replace each logical tensor by this rank's slice."""
    params = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))  # tied: every name
    for key in list(state_dict):
        if key in params:
            state_dict[key] = _local_value(key, state_dict[key], params[key])


def check_all_loaded(load_result, adapter_name: str) -> None:
    """ValueError when an adapter's keys did not all load (peft only warns)."""
    missing = [k for k in load_result.missing_keys
               if ("lora_" in k and f".{adapter_name}." in k) or f"modules_to_save.{adapter_name}." in k]
    if missing or load_result.unexpected_keys:
        raise ValueError(
            f"adapter {adapter_name!r} does not match this model: missing {missing[:8]}, unexpected "
            f"{list(load_result.unexpected_keys)[:8]} (is it for another architecture or target_modules?)"
        )


def is_writer() -> bool:
    """The one rank that writes a saved adapter (global rank 0)."""
    return backend.rank() == 0


def check_every_rank_saves() -> None:
    """Saving is collective: a rank that calls it alone gets an error naming the ranks that did
    not arrive within ``SAVE_ARRIVAL_TIMEOUT_S`` (gloo), or the process group's timeout (others)."""
    try:
        backend.arrival_barrier(SAVE_ARRIVAL_TIMEOUT_S)
    except RuntimeError as err:
        raise ValueError(
            "save_pretrained on an nxd_hf parallel peft model is collective: every rank must call it (rank 0 "
            f"writes). Some ranks did not within {SAVE_ARRIVAL_TIMEOUT_S:.0f}s: {err}"
        ) from err
