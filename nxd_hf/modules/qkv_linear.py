"""Fused Q/K/V projection for grouped-query attention, sharded over TP (NxD's
``modules.qkv_linear.GQAQKVColumnParallelLinear``), laid out as ``nxd_hf.parallel_layers.heads``
describes: K/V replicated ``kv_size_multiplier`` times head by head, Q sharded contiguously and
padded with zero heads where needed. ``q_shard_index`` names the real query rows so the output
projection can mask the padded ones (pass it as ``RowParallelLinear(..., shard_index=layer.q_shard_index)``).
Backward sums the gradients of all copies of a K/V row over the TP group, so every copy's
gradient equals the gradient of the unreplicated K/V weight.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf.parallel_layers import mappings
from nxd_hf.parallel_layers.heads import gqa_layout
from nxd_hf.parallel_layers.layers import linear_init_, set_local_
from nxd_hf.parallel_layers.sharding import (
    gather_logical, gather_positions, set_tensor_model_parallel_attributes, shard_from_full, tp_coords,
)


def nxd_row_layout(q_size: int, kv_size: int, kv_size_multiplier: int, tp_rank: int, tp_size: int):
    """NxD's layout, by rows (no head size needed): Q split contiguously; K (and V) stacked
    ``kv_size_multiplier`` times whole (``k k``) and that stack split contiguously. Returns
    (q_rows, kv_rows, None), as ``gqa_layout`` (head counts are unknown here). The attention
    using it must match each rank's query rows to its K/V rows, as NxD's models do;
    ``head_dim=`` gives the layout that keeps Hugging Face's head order instead."""
    if q_size % tp_size or (kv_size * kv_size_multiplier) % tp_size:
        raise ValueError(
            f"GQAQKVColumnParallelLinear: output_sizes [{q_size}, {kv_size}] x kv_size_multiplier "
            f"{kv_size_multiplier} do not split over {tp_size} TP ranks; pass head_dim= to pad heads, or a "
            "kv_size_multiplier that makes kv_size x kv_size_multiplier divisible by the TP size")
    q_local, kv_local = q_size // tp_size, kv_size * kv_size_multiplier // tp_size
    q_rows = torch.arange(tp_rank * q_local, (tp_rank + 1) * q_local)
    kv_rows = torch.arange(tp_rank * kv_local, (tp_rank + 1) * kv_local) % kv_size
    return q_rows, kv_rows, None


class GQAQKVColumnParallelLinear(nn.Module):
    """Q, K, V = X W_q + b_q, X W_k + b_k, X W_v + b_v with the layout in the module docstring.
    Returns ``(q, k, v)``, local (``[b, s, heads_local * head_dim]``) unless ``gather_output``.
    Without ``head_dim`` (NxD's signature) the layout is NxD's (``nxd_row_layout``); with it,
    the head layout of the module docstring."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = True,
        sequence_parallel_enabled: bool = False, dtype: torch.dtype = torch.float32, device=None,
        init_method: Callable | None = None, kv_size_multiplier: int = 1, fuse_qkv: bool = True,
        *, head_dim: int | None = None,
    ):
        super().__init__()
        q_size, kv_size = output_sizes
        tp_rank, tp_size = tp_coords()
        self.input_size, self.q_size, self.kv_size, self.head_dim = input_size, q_size, kv_size, head_dim
        self.gather_output, self.sequence_parallel_enabled = gather_output, sequence_parallel_enabled
        self.init_method, self.kv_size_multiplier, self.fuse_qkv = init_method, kv_size_multiplier, fuse_qkv
        if head_dim is None:
            layouts = [nxd_row_layout(q_size, kv_size, kv_size_multiplier, r, tp_size) for r in range(tp_size)]
        else:
            layouts = [
                gqa_layout(q_size // head_dim, kv_size // head_dim, head_dim, kv_size_multiplier, r, tp_size)
                for r in range(tp_size)
            ]
        self.q_shard_index, self.kv_shard_index, padded_heads = layouts[tp_rank]
        self.q_output_size_per_partition, self.kv_output_size_per_partition = (
            len(self.q_shard_index), len(self.kv_shard_index))  # NxD's names
        if head_dim is not None:
            self.num_heads_per_partition = padded_heads // tp_size
            self.num_kv_heads_per_partition = len(self.kv_shard_index) // head_dim
        self._q_positions = gather_positions([lay[0] for lay in layouts], q_size)
        self._kv_positions = gather_positions([lay[1] for lay in layouts], kv_size)
        self._make_params(bias, dtype, device)
        if not next(self.parameters()).is_meta:
            self.init_weight_cpu()

    def _parts(self):
        """(name suffix, local rows into the fused logical [q; k; v], replicas) per projection."""
        q, kv = self.q_shard_index, self.kv_shard_index
        return [("q", q, 1), ("k", kv, self.kv_size_multiplier), ("v", kv, self.kv_size_multiplier)]

    def _make_params(self, bias: bool, dtype, device) -> None:
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        if self.fuse_qkv:
            rows = torch.cat([torch.where(r >= 0, r + offsets[n], -1) for n, r, _ in self._parts()])
            replicas = torch.cat([torch.full((len(r),), m) for _, r, m in self._parts()])
            specs = [("qkv", rows, self.q_size + 2 * self.kv_size, replicas)]
        else:
            specs = [(n, r, sizes[n], m) for n, r, m in self._parts()]
        for suffix, rows, logical, replicas in specs:
            for kind, shape in (("weight", (len(rows), self.input_size)), ("bias", (len(rows),))):
                if kind == "bias" and not bias:
                    self.register_parameter(f"bias_{suffix}", None)
                    continue
                param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
                set_tensor_model_parallel_attributes(
                    param, partition_dim=0, logical_size=logical, shard_index=rows, num_replicas=replicas
                )
                setattr(self, f"{kind}_{suffix}", param)

    def init_weight_cpu(self) -> None:
        """(Re-)initialize as slices of three ``nn.Linear`` (q, k, v, in that order) built on CPU."""
        full = {}
        for name, size in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
            weight, bias = torch.empty(size, self.input_size), torch.empty(size)
            linear_init_(weight, bias, self.init_method)
            full[name] = (weight, bias)
        self.load_unsharded(*(full[n][0] for n in "qkv"), *(full[n][1] for n in "qkv"))

    def load_unsharded(self, q_weight, k_weight, v_weight, q_bias=None, k_bias=None, v_bias=None) -> None:
        """Set this rank's shard from the unsharded q/k/v weights (and biases)."""
        if self.fuse_qkv:
            weight = torch.cat([q_weight, k_weight, v_weight])
            set_local_(self, "weight_qkv", shard_from_full(weight, 0, self.weight_qkv.shard_index))
            if self.bias_qkv is not None:
                bias = torch.cat([q_bias, k_bias, v_bias])
                set_local_(self, "bias_qkv", shard_from_full(bias, 0, self.bias_qkv.shard_index))
            return
        for name, weight, bias in (("q", q_weight, q_bias), ("k", k_weight, k_bias), ("v", v_weight, v_bias)):
            set_local_(self, f"weight_{name}", shard_from_full(weight, 0, getattr(self, f"weight_{name}").shard_index))
            if getattr(self, f"bias_{name}") is not None:
                set_local_(self, f"bias_{name}", shard_from_full(bias, 0, getattr(self, f"bias_{name}").shard_index))

    def _local_weights(self, kind: str) -> list[torch.Tensor | None]:
        if self.fuse_qkv:
            fused = getattr(self, f"{kind}_qkv")
            if fused is None:
                return [None, None, None]
            q_rows, kv_rows = len(self.q_shard_index), len(self.kv_shard_index)
            return list(fused.split([q_rows, kv_rows, kv_rows]))
        return [getattr(self, f"{kind}_{n}") for n in "qkv"]

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel_enabled:
            x = mappings.gather_from_sequence_parallel_region(x, to_model_parallel=True)  # [b, s, h]
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x)
        weights, biases = self._local_weights("weight"), self._local_weights("bias")
        if self.kv_size_multiplier > 1:
            rows = self.kv_shard_index
            weights[1:] = [mappings.SumReplicaGrads.apply(w, rows, self.kv_size) for w in weights[1:]]
            if biases[0] is not None:
                biases[1:] = [mappings.SumReplicaGrads.apply(b, rows, self.kv_size) for b in biases[1:]]
        q, k, v = (F.linear(x, w, b) for w, b in zip(weights, biases))
        if not self.gather_output:
            return q, k, v
        return (
            gather_logical(q, self._q_positions, self.q_size),
            gather_logical(k, self._kv_positions, self.kv_size),
            gather_logical(v, self._kv_positions, self.kv_size),
        )
