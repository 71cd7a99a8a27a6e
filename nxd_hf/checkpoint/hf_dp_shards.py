"""Read a Hugging Face checkpoint straight into the data-parallel shards of a ZeRO-2/3 model.

``nxd_hf.from_pretrained(..., data_parallel_sharding="zero3")`` builds the model on the meta
device, shards it over TP, lets FSDP2 shard it over DP (still on meta) and gives each parameter
its local shard only (``nxd_hf.fsdp.load``); this module then fills each local shard from the
files, reading only its rows. The local shard of a DTensor holds rows ``[start, start + n)`` along
dim 0 of the TP-local tensor (``dp_shard.dp_rows``), so in the stored tensor that is:

- replicated over TP: rows ``start..start + n`` along dim 0;
- TP-sharded along dim 0: the stored rows ``shard_index[start:start + n]`` along dim 0;
- TP-sharded along another dim: the TP rows ``shard_index`` along that dim, within rows
  ``start..start + n`` along dim 0 (a box);
- HF ``Conv1D`` weights (GPT-2) are stored ``[in, out]``: the same with the two dims swapped, the
  box transposed after reading.

No rank ever holds a TP shard whole: the largest tensor read is one parameter's DP shard
(``LoadReport.largest_bytes``). Per-expert checkpoints of fused experts are the exception: their
TP-local tensor is read (one parameter) and this rank's rows are kept.
"""

import torch
from torch import nn

from nxd_hf.checkpoint.dp_shard import dp_rows, local_of
from nxd_hf.checkpoint.fused_experts import read_fused
from nxd_hf.checkpoint.hf_safetensors import HFKeys, LoadReport, SafetensorsCheckpoint, parameter_keys
from nxd_hf.parallel_layers.sharding import is_expert_parallel, is_sharded


def read_dp_shard(checkpoint: SafetensorsCheckpoint, key: str, param: torch.Tensor) -> torch.Tensor:
    """This DP rank's rows of the DTensor ``param`` from the stored tensor ``key`` (module docstring)."""
    start, count, _ = dp_rows(param)
    transposed = getattr(param, "hf_transposed", False)
    assert not transposed or param.dim() == 2, "HF Conv1D weights are 2-D"

    def stored(dim: int) -> int:  # the stored dim of the TP-local tensor's dim
        return 1 - dim if transposed else dim

    if not is_sharded(param):
        data = checkpoint.read_rows(key, stored(0), torch.arange(start, start + count))
    elif param.partition_dim == 0:
        data = checkpoint.read_rows(key, stored(0), param.shard_index[start:start + count])
    else:
        data = checkpoint.read_rows(key, stored(param.partition_dim), param.shard_index,
                                    within=(stored(0), start, start + count))
    return data.t() if transposed else data


@torch.no_grad()
def load_hf_into_dp_shards(modules: list[nn.Module], path: str, *, hf_model: nn.Module | None = None,
                           hf_name=None) -> LoadReport:
    """Copy into the local shard of every DP-sharded parameter of ``modules`` its rows of the
    checkpoint at ``path`` (the shards are allocated, on their device; buffers were loaded before
    sharding by ``load_hf_safetensors(..., parameters=False)``). ``hf_name``: as ``parameter_keys``'s
    (LoRA: ``q_proj.base_layer.weight`` is ``q_proj.weight``; the adapters, made at setup, are skipped)."""
    checkpoint = SafetensorsCheckpoint(path)
    key_of = HFKeys(hf_model if hf_model is not None else modules[0], checkpoint.files)
    named, keys, fused = parameter_keys(modules, checkpoint, key_of, hf_model, path, hf_name=hf_name)
    for name, param in named:
        local = local_of(param)
        assert local is not param and not local.is_meta, f"{name}: expected an allocated DP shard (FSDP2's DTensor)"
        assert not is_expert_parallel(param), "expert parallelism is refused with data_parallel_sharding"
        if name in fused:
            start, count, _ = dp_rows(param)  # per-expert files: this rank's TP-local tensor, then its rows
            data = read_fused(checkpoint, fused[name], param)[start:start + count]
        else:
            data = read_dp_shard(checkpoint, keys[name], param)
        assert data.shape == local.shape, f"{name}: read {tuple(data.shape)} for a shard of {tuple(local.shape)}"
        local.copy_(data)
    return checkpoint.report
