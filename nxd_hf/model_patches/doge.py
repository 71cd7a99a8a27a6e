"""Doge: HF's plan (derived as for any architecture) plus its dynamic-mask projection.

Doge's attention has a second rowwise layer, ``dt_proj``: it reads every value head and gives one
value per K/V head, which (times the per-K/V-head parameter ``A``) weights that head's keys. With
the value heads sharded, ``dt_proj`` is row-parallel over this rank's value rows (its all-reduced
output holds every K/V head) and each rank keeps its own K/V heads' outputs; going back, the
gradient of the kept outputs is all-reduced first, since every rank's value heads fed every
output. ``A`` keeps this rank's K/V heads (0 for padding heads). K/V heads replicated over TP
(fewer K/V heads than ranks) are refused: the row-parallel sum would count each copy.
"""

import dataclasses

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from nxd_hf.parallel_layers import mappings
from nxd_hf.parallel_layers.sharding import (
    mark_partial_grad_over_tp, set_tensor_model_parallel_attributes, shard_from_full,
)
from nxd_hf.tp.derive import patch_from_hf_plan
from nxd_hf.tp.plan import PerHeadNorm
from nxd_hf.tp.registry import register_patch


class KVHeadProjection(nn.Module):
    """``dt_proj`` over this rank's value rows (``weight`` [kv heads, local value rows], row-parallel),
    its output narrowed to this rank's K/V heads (-1: a padding head, 0). The bias is added per
    local head, so its gradient is partial (summed over TP)."""

    def __init__(self, dt_proj: nn.Linear, value_rows: torch.Tensor, kv_heads: torch.Tensor):
        super().__init__()
        self.kv_heads = kv_heads
        self.weight = nn.Parameter(shard_from_full(dt_proj.weight.detach(), 1, value_rows),
                                   requires_grad=dt_proj.weight.requires_grad)
        set_tensor_model_parallel_attributes(self.weight, partition_dim=1, logical_size=dt_proj.in_features,
                                             shard_index=value_rows)
        self.bias = None
        if dt_proj.bias is not None:
            self.bias = nn.Parameter(dt_proj.bias.detach().clone(), requires_grad=dt_proj.bias.requires_grad)
            mark_partial_grad_over_tp(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = mappings.reduce_from_tensor_model_parallel_region(F.linear(x, self.weight))  # every K/V head
        local = shard_from_full(mappings.copy_to_tensor_model_parallel_region(full), full.dim() - 1, self.kv_heads)
        return local if self.bias is None else local + shard_from_full(self.bias, 0, self.kv_heads)


def _local_kv_heads(k_proj: nn.Module, head_dim: int) -> torch.Tensor:
    rows = k_proj.weight.shard_index.view(-1, head_dim)[:, 0]
    return torch.where(rows >= 0, rows // head_dim, -1)


def _shard_dt_proj(name: str, attention: nn.Module) -> None:
    k_proj, dt_proj, head_dim = attention.k_proj, attention.dt_proj, attention.head_dim
    if getattr(k_proj.weight, "num_replicas", 1) > 1:
        raise ValueError(
            f"{name}: Doge's dt_proj reads every value head, and with fewer K/V heads than tensor-parallel ranks the "
            "K/V heads are replicated, which a row-parallel dt_proj would count once per copy. Use a "
            "tensor_parallel_size that divides num_key_value_heads")
    kv_heads = _local_kv_heads(k_proj, head_dim)
    attention.dt_proj = KVHeadProjection(dt_proj, k_proj.weight.shard_index, kv_heads)
    a = attention.A
    local = nn.Parameter(shard_from_full(a.detach(), 0, kv_heads), requires_grad=a.requires_grad)
    set_tensor_model_parallel_attributes(local, partition_dim=0, logical_size=a.shape[0], shard_index=kv_heads)
    attention.A = local


def shard_dynamic_mask(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if type(module).__name__ == "DogeAttention":
            _shard_dt_proj(name, module)


_HF_PLAN = {k: v for k, v in transformers.DogeConfig.base_model_tp_plan.items() if not k.endswith(".dt_proj")}
_DERIVED = patch_from_hf_plan("doge", _HF_PLAN)
# q_norm/k_norm: replicated head_dim norms on this rank's heads, gradients summed over TP (as Qwen3's).
# SP stays off: the plan gathers its MoE router's output (colwise_gather_output).
PATCH = register_patch(dataclasses.replace(
    _DERIVED, plan={**_DERIVED.plan, "layers.*.self_attn.q_norm": PerHeadNorm(), "layers.*.self_attn.k_norm": PerHeadNorm()},
    after_swap=shard_dynamic_mask))
