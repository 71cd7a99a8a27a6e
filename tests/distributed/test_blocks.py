"""Composite checks: a Column->Row MLP, an MHA block padded by pad_model, and model-parallel
RNG keeping replicated parameters identical across TP ranks under dropout."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear, mappings, pad_model
from nxd_hf.parallel_layers.grads import allreduce_sequence_parallel_gradients
from nxd_hf.parallel_layers.pad import get_number_of_extra_heads
from nxd_hf.parallel_layers.random import get_rng_state_tracker, model_parallel_manual_seed
from nxd_hf.parallel_layers.sharding import mark_partial_grad_over_tp

from support.layers import TOL, assert_grads_match, seq_chunk, sharded_input, tp_info

B, S, H, HEAD_DIM = 2, 8, 24, 4


class MLP(nn.Module):
    def __init__(self, hidden, inner, sp=False, parallel=True):
        super().__init__()
        if parallel:
            self.up = ColumnParallelLinear(hidden, inner, gather_output=False, sequence_parallel_enabled=sp)
            self.down = RowParallelLinear(inner, hidden, input_is_parallel=True, sequence_parallel_enabled=sp)
        else:
            self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Multi-head attention; with ``parallel`` its q/k/v/o are parallel layers over local heads."""

    def __init__(self, hidden, num_heads, parallel, dropout=0.0):
        super().__init__()
        size, self.dropout = num_heads * HEAD_DIM, dropout
        if parallel:
            self.q, self.k, self.v = (ColumnParallelLinear(hidden, size, gather_output=False) for _ in range(3))
            self.o = RowParallelLinear(size, hidden, input_is_parallel=True)
            _, tp_size = tp_info()
            self.num_heads = (num_heads + get_number_of_extra_heads(num_heads, tp_size)) // tp_size
        else:
            self.q, self.k, self.v = (nn.Linear(hidden, size) for _ in range(3))
            self.o, self.num_heads = nn.Linear(size, hidden), num_heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.dropout and self.training:
            with get_rng_state_tracker().fork():  # sharded region: a mask per TP rank
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def check_mlp(sp: bool) -> None:
    torch.manual_seed(3)
    ref = MLP(H, 36, parallel=False)
    torch.manual_seed(3)
    mlp = MLP(H, 36, sp=sp)
    x_full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    y_ref = ref(x_full)
    y_ref.square().sum().backward()
    x = sharded_input(x_full, sp)
    y = mlp(x)
    torch.testing.assert_close(y, seq_chunk(y_ref, sp).detach(), **TOL)
    y.square().sum().backward()
    if sp:
        mark_partial_grad_over_tp(mlp.down.bias)
        allreduce_sequence_parallel_gradients(mlp.parameters())
    torch.testing.assert_close(x.grad, seq_chunk(x_full.grad, sp), **TOL)
    assert_grads_match(mlp.up.weight, ref.up.weight.grad, "up weight")
    assert_grads_match(mlp.up.bias, ref.up.bias.grad, "up bias")
    assert_grads_match(mlp.down.weight, ref.down.weight.grad, "down weight")
    torch.testing.assert_close(mlp.down.bias.grad, ref.down.bias.grad, **TOL)


def _check_block_outputs_and_input_grads(block, ref, *, seed: int) -> None:
    """Same input through both blocks: equal outputs and input gradients (loss: sum of squares)."""
    x_full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    y_ref = ref(x_full)
    y_ref.square().sum().backward()
    x = x_full.detach().clone().requires_grad_(True)
    y = block(x)
    torch.testing.assert_close(y, y_ref.detach(), **TOL)
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad, **TOL)


def check_padded_attention(num_heads: int) -> None:
    """Heads not divisible by tp: pad_model re-lays q/k/v/o and the block equals the original,
    gradients included, and padded weights get exactly zero gradient."""
    torch.manual_seed(4)
    ref = Attention(H, num_heads, parallel=False)
    torch.manual_seed(4)
    block = Attention(H, num_heads, parallel=True)
    _, tp_size = tp_info()
    pad_model(block, tp_size, num_heads)
    _check_block_outputs_and_input_grads(block, ref, seed=2)
    for name in "qkvo":
        layer, ref_layer = getattr(block, name), getattr(ref, name)
        assert_grads_match(layer.weight, ref_layer.weight.grad, f"{name} weight")
        padded = layer.weight.shard_index < 0
        dim = layer.weight.partition_dim
        assert torch.all(layer.weight.grad.movedim(dim, 0)[padded] == 0), f"{name}: padded rows got gradient"


class GQAAttention(nn.Module):
    """Grouped-query attention; with ``parallel``, GQAQKVColumnParallelLinear (K/V replicated,
    query heads padded per group) and an output projection laid out like the queries."""

    def __init__(self, hidden, num_heads, num_kv_heads, parallel):
        super().__init__()
        q_size, kv_size = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
        if parallel:
            _, tp_size = tp_info()
            m = next(k for k in range(1, tp_size + 1) if (num_kv_heads * k) % tp_size == 0)
            self.qkv = GQAQKVColumnParallelLinear(
                hidden, [q_size, kv_size], gather_output=False, kv_size_multiplier=m, head_dim=HEAD_DIM
            )
            self.o = RowParallelLinear(q_size, hidden, input_is_parallel=True, shard_index=self.qkv.q_shard_index)
            self.num_heads, self.num_kv_heads = self.qkv.num_heads_per_partition, self.qkv.num_kv_heads_per_partition
        else:
            self.q, self.k, self.v = nn.Linear(hidden, q_size), nn.Linear(hidden, kv_size), nn.Linear(hidden, kv_size)
            self.o, self.num_heads, self.num_kv_heads = nn.Linear(q_size, hidden), num_heads, num_kv_heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))
        q = q.view(b, s, self.num_heads, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(b, s, self.num_kv_heads, HEAD_DIM).transpose(1, 2) for t in (k, v))
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # HF repeat_kv
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def check_gqa_attention(num_heads: int, num_kv_heads: int) -> None:
    """GQA block (kv_heads < tp, heads not divisible by tp) against the unsharded block."""
    torch.manual_seed(6)
    ref = GQAAttention(H, num_heads, num_kv_heads, parallel=False)
    torch.manual_seed(6)  # same draws: q, k, v, o in order
    block = GQAAttention(H, num_heads, num_kv_heads, parallel=True)
    _check_block_outputs_and_input_grads(block, ref, seed=5)
    full_qkv = [torch.cat([ref.q.weight.grad, ref.k.weight.grad, ref.v.weight.grad]),
                torch.cat([ref.q.bias.grad, ref.k.bias.grad, ref.v.bias.grad])]
    assert_grads_match(block.qkv.weight_qkv, full_qkv[0], "qkv weight")
    assert_grads_match(block.qkv.bias_qkv, full_qkv[1], "qkv bias")
    assert_grads_match(block.o.weight, ref.o.weight.grad, "o weight")
    padded_columns = block.o.weight.shard_index < 0
    assert torch.all(block.o.weight.grad[:, padded_columns] == 0), "padded query heads leaked into o_proj grads"


def check_rng_keeps_replicas_equal(sp: bool) -> None:
    """Dropout 0.1 in replicated and sharded regions, 3 SGD steps: replicated parameters stay
    bitwise equal on every TP rank, and the sharded-region generator differs per rank."""
    torch.manual_seed(0)
    norm, attn, mlp = nn.LayerNorm(H), Attention(H, 8, parallel=True, dropout=0.1), MLP(H, 32, sp=False)
    model = nn.ModuleList([norm, attn, mlp])
    model_parallel_manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(step))
        h = x + F.dropout(attn(norm(x)), 0.1)  # replicated region: same mask everywhere
        y = h + F.dropout(mlp(h), 0.1)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    group = parallel_state.get_tensor_model_parallel_group()
    _, tp_size = tp_info()
    replicated = [norm.weight, norm.bias, attn.o.bias, mlp.down.bias]
    for p in replicated:
        copies = [torch.empty_like(p) for _ in range(tp_size)]
        torch.distributed.all_gather(copies, p.detach(), group=group)
        assert all(torch.equal(c, copies[0]) for c in copies), "replicated parameter drifted across TP ranks"
    with get_rng_state_tracker().fork():
        draw = torch.rand(4)
    draws = [torch.empty(4) for _ in range(tp_size)]
    torch.distributed.all_gather(draws, draw, group=group)
    assert tp_size == 1 or not torch.equal(draws[0], draws[1]), "sharded-region RNG must differ per TP rank"


TP = pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sequence_parallel"])
@TP
def test_column_row_mlp_matches_unsharded(ranks4, tp, sp):
    ranks4.run(check_mlp, sp, model_parallel=(tp, 1))


@pytest.mark.parametrize("num_heads", [6, 5, 8], ids=lambda n: f"{n}_heads")
@TP
def test_attention_heads_padded_by_pad_model_match_unsharded(ranks4, tp, num_heads):
    ranks4.run(check_padded_attention, num_heads, model_parallel=(tp, 1))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 2), (6, 3), (4, 1)],
                         ids=["6q_2kv", "8q_2kv", "6q_3kv", "4q_1kv"])
@TP
def test_gqa_attention_kv_heads_replicated_when_fewer_than_tp(ranks4, tp, num_heads, num_kv_heads):
    ranks4.run(check_gqa_attention, num_heads, num_kv_heads, model_parallel=(tp, 1))


@TP
def test_model_parallel_rng_keeps_replicas_equal_under_dropout(ranks4, tp):
    ranks4.run(check_rng_keeps_replicas_equal, False, model_parallel=(tp, 1))


def check_sequence_parallel_entry() -> None:
    """The SP entry splits HF's sequence dim (dim 1 of [batch, seq, hidden]) into this rank's
    contiguous chunk, its exit gathers it back, and an indivisible sequence is a ValueError."""
    tp_rank, tp_size = tp_info()
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    chunk = mappings.scatter_to_sequence_parallel_region(x)
    assert torch.equal(chunk, x[:, tp_rank * 2 : (tp_rank + 1) * 2]), chunk.shape
    assert torch.equal(mappings.gather_from_sequence_parallel_region(chunk, to_model_parallel=False), x)
    with pytest.raises(ValueError, match=r"sequence length \(6\) .*pad_to_multiple_of=4"):
        mappings.scatter_to_sequence_parallel_region(torch.zeros(2, 6, 3))


def test_sequence_parallel_entry_splits_the_sequence_and_rejects_an_indivisible_one(ranks4):
    ranks4.run(check_sequence_parallel_entry, model_parallel=(4, 1))
