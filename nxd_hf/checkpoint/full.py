"""Whole (gathered, unpadded) tensors of a running parallel model, for small models and tests.

``model.state_dict()`` on a parallelized model returns this rank's local, padded shards under
the HF names: saved with ``torch.save`` it looks like a model but is not one. Use
``save_checkpoint`` / ``save_pretrained`` to write, or ``full_state_dict`` to hold the real
tensors in memory (every tensor gathered over TP and PP: the whole model on each receiving rank).
"""

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import optim_state
from nxd_hf.checkpoint.dp_shard import as_dp_shard
from nxd_hf.checkpoint.logical import LogicalTensor, TensorSet, logical_tensors, named_local_tensors
from nxd_hf.parallel_layers.sharding import full_tensor


def _gather_tp(lt: LogicalTensor, value: torch.Tensor) -> torch.Tensor:
    if lt.dim is None or value.shape != lt.tensor.shape:
        return lt.to_disk(value.detach()) if value.shape == lt.tensor.shape else value.detach()
    return lt.to_disk(full_tensor(lt.tensor, value))  # over TP and over EP for experts


def _dp_sharded(model) -> dict[str, torch.Tensor]:
    """model name -> parameter, for those FSDP2 shards over DP (ZeRO-2/3): DTensors, whose
    ``LogicalTensor`` holds only this rank's local shard."""
    if isinstance(model, TensorSet):
        return {}
    return {name: t for name, t in named_local_tensors(model, buffers=False) if type(t).__name__ == "DTensor"}


def _whole(lt: LogicalTensor, value: torch.Tensor, dp_sharded: dict) -> torch.Tensor:
    param = dp_sharded.get(lt.model_name)
    if param is None or value.dim() == 0:
        return _gather_tp(lt, value)
    # gathered over DP first (FSDP2's DTensor), then over TP and EP as any parameter
    return lt.to_disk(full_tensor(param, as_dp_shard(param, value).full_tensor()))


def _gather(entries: list[tuple[str, LogicalTensor, torch.Tensor]], rank0_only: bool,
            dp_sharded: dict) -> dict | None:
    """name -> whole tensor, from every pipeline stage; a weight tied across stages once."""
    local = {}
    for name, lt, value in entries:
        full = _whole(lt, value, dp_sharded)
        if getattr(lt.tensor, "count_in_grad_norm", True) and not lt.tied_copy:
            local[name] = full.cpu().clone()
    merged = {}
    for part in backend.all_gather_object(local, parallel_state.get_pipeline_model_parallel_group()):
        merged.update(part)
    if rank0_only and backend.rank() != 0:
        return None
    return dict(sorted(merged.items()))


def full_state_dict(model, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The model's tensors gathered over TP and PP, unpadded, under the names ``save_pretrained``
    writes (HF ``Conv1D`` weights ``[in, out]``); every rank calls it. ``rank0_only``: other
    ranks get None (the gathers still run on all of them)."""
    return _gather([(lt.name, lt, lt.tensor) for lt in logical_tensors(model)], rank0_only, _dp_sharded(model))


def full_optimizer_state(model, optimizer, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
    """``<name>::<key>`` -> the whole optimizer state tensor (Adam moments, step, fp32 master),
    the same whatever the parallel sizes and ZeRO-1: what a checkpoint stores."""
    states = optim_state.param_states(optimizer)
    entries = []
    for lt in logical_tensors(model):
        for key, value in sorted(states.get(id(lt.tensor), (None, {}))[1].items()):
            entries.append((f"{lt.name}::{key}", lt, value))
    return _gather(entries, rank0_only, _dp_sharded(model))
