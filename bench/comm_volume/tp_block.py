"""A pre-norm Llama/Qwen2-style transformer block built from nxd_hf's parallel layers, and the
unsharded reference it must match: the subject of ``bench/comm_volume/run.py`` and its test.

    x -> RMSNorm -> GQA QKV (column) -> causal attention -> o_proj (row) -> + x
      -> RMSNorm -> gate|up (column, fused) -> silu(gate) * up -> down (row) -> +

Under sequence parallelism the block's input and output are ``[b, s/tp, h]``: each column
layer all-gathers the sequence and each row layer reduce-scatters it (Megatron-SP), and the
norm weights get partial gradients that ``allreduce_sequence_parallel_gradients`` sums.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from nxd_hf.parallel_layers.sharding import local_shard, mark_partial_grad_over_tp


@dataclasses.dataclass(kw_only=True)
class BlockConfig:
    batch: int = 2  # sequences per batch
    seq: int = 128  # tokens per sequence; a multiple of tp under sequence parallelism
    hidden: int = 256  # model width h
    num_heads: int = 8  # query heads
    num_kv_heads: int = 2  # K/V heads (GQA); fewer than tp forces K/V replication
    intermediate: int = 512  # MLP width (gate and up each)
    qkv_bias: bool = True  # Qwen2-style Q/K/V biases; o_proj and the MLP have none (Llama, Qwen2)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


def kv_size_multiplier(num_kv_heads: int, tp_size: int) -> int:
    """The fewest copies of each K/V head that let ``tp_size`` ranks split them evenly."""
    return tp_size // math.gcd(num_kv_heads, tp_size)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (Llama's norm), in plain torch."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal SDPA over whatever heads are here; each K/V head serves a contiguous group of
    query heads (HF's ``repeat_kv``), which holds for a rank's local heads too."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)  # [b, s, heads * d]


class ReferenceBlock(nn.Module):
    """The unsharded block, in plain torch modules."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        c, d = config, config.head_dim
        self.head_dim = d
        self.norm1, self.norm2 = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.q_proj = nn.Linear(c.hidden, c.num_heads * d, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden, c.num_kv_heads * d, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden, c.num_kv_heads * d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden, bias=False)
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o_proj(causal_attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.head_dim))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TPBlock(nn.Module):
    """The same block sharded over the TP group: heads and MLP columns split, K/V replicated
    when there are fewer K/V heads than ranks."""

    def __init__(self, config: BlockConfig, *, sequence_parallel: bool):
        super().__init__()
        c, d, sp = config, config.head_dim, sequence_parallel
        m = kv_size_multiplier(c.num_kv_heads, parallel_state.get_tensor_model_parallel_size())
        self.head_dim = d
        self.norm1, self.norm2 = RMSNorm(c.hidden), RMSNorm(c.hidden)
        for norm in (self.norm1, self.norm2):
            mark_partial_grad_over_tp(norm.weight, sp)
        self.qkv = GQAQKVColumnParallelLinear(
            c.hidden, [c.num_heads * d, c.num_kv_heads * d], bias=c.qkv_bias, gather_output=False,
            sequence_parallel_enabled=sp, kv_size_multiplier=m, head_dim=d,
        )
        self.o_proj = RowParallelLinear(
            c.num_heads * d, c.hidden, bias=False, input_is_parallel=True, sequence_parallel_enabled=sp,
            shard_index=self.qkv.q_shard_index,
        )
        # gate and up fused (stride 2: rank r holds [gate_r; up_r]) so the MLP input is
        # gathered (SP) or all-reduced in backward (no SP) once, not twice.
        self.gate_up = ColumnParallelLinear(
            c.hidden, 2 * c.intermediate, bias=False, gather_output=False, sequence_parallel_enabled=sp, stride=2
        )
        self.down = RowParallelLinear(
            c.intermediate, c.hidden, bias=False, input_is_parallel=True, sequence_parallel_enabled=sp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h], or [b, s/tp, h] under SP
        q, k, v = self.qkv(self.norm1(x))  # [b, s, heads_local * d]
        x = x + self.o_proj(causal_attention(q, k, v, self.head_dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)  # [b, s, intermediate/tp] each
        return x + self.down(F.silu(gate) * up)


def unsharded_tensors(ref: ReferenceBlock, pick) -> dict[str, torch.Tensor]:
    """``pick(param)`` (its data or grad) of every reference parameter, keyed and fused as the
    parameter of ``TPBlock`` that holds it."""
    fused = {
        "norm1.weight": [ref.norm1.weight],
        "norm2.weight": [ref.norm2.weight],
        "qkv.weight_qkv": [ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight],
        "o_proj.weight": [ref.o_proj.weight],
        "gate_up.weight": [ref.gate_proj.weight, ref.up_proj.weight],
        "down.weight": [ref.down_proj.weight],
    }
    if ref.q_proj.bias is not None:
        fused["qkv.bias_qkv"] = [ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]
    return {name: torch.cat([pick(p) for p in params]) for name, params in fused.items()}


def local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the unsharded ``full`` that ``param`` holds on this rank."""
    return local_shard(param, full)


def load_from_reference_(block: TPBlock, ref: ReferenceBlock) -> None:
    """Set every parameter of ``block`` to this rank's part of the reference's weights."""
    full = unsharded_tensors(ref, lambda p: p.detach())
    params = dict(block.named_parameters())
    assert params.keys() == full.keys(), (params.keys(), full.keys())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local_part(param, full[name]))
