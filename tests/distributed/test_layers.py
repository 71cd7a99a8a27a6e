"""Parallel layers against nn.Linear / nn.Embedding / three q,k,v nn.Linear at tp 1, 2, 4,
sequence parallel on and off: outputs, input grads and gathered weight/bias grads."""

import itertools

import pytest
import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxd_hf.parallel_layers import (
    ColumnParallelLinear, mappings, move_model_to_device, ParallelEmbedding, RowParallelLinear,
)
from nxd_hf.parallel_layers.heads import auto_kv_size_multiplier, gqa_layout
from nxd_hf.parallel_layers.sharding import contiguous_shard_index
from support.layers import assert_grads_match, seq_chunk, sharded_input, TOL, tp_info


def on_device(*items):
    """Modules (sharding metadata kept) and tensors on the backend's compute device."""
    device = backend.default_device()
    return [move_model_to_device(item, device) if isinstance(item, nn.Module) else item.to(device) for item in items]


def last_dim_chunk(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Columns ``index`` of a full tensor (zeros for -1), as a sharded output holds them."""
    index = index.to(x.device)
    picked = x.index_select(-1, index.clamp(min=0))
    return picked * (index >= 0).to(x.dtype)


def check_sp_sequence_error() -> None:
    """An indivisible sequence under SP is a ValueError that names the fix."""
    _, tp_size = tp_info()
    if tp_size == 1:
        return
    try:
        mappings.scatter_to_sequence_parallel_region(torch.zeros(1, tp_size + 1, 4))
    except ValueError as error:
        assert "pad_to_multiple_of" in str(error), error
    else:
        raise AssertionError("expected ValueError for a sequence not divisible by tp")


B, S, H = 2, 8, 12


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g)


def check_column(out_size: int, bias: bool, gather: bool, sp: bool) -> None:
    torch.manual_seed(7)
    ref = nn.Linear(H, out_size, bias=bias)
    torch.manual_seed(7)
    layer = ColumnParallelLinear(H, out_size, bias=bias, gather_output=gather, sequence_parallel_enabled=sp)
    ref, layer, x_full = on_device(ref, layer, _inputs())
    x_full.requires_grad_(True)
    y_ref = ref(x_full)
    (probe,) = on_device(torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3)))
    (y_ref * probe).sum().backward()

    x = sharded_input(x_full, sp)
    y = layer(x)
    expected = y_ref if gather else last_dim_chunk(y_ref, layer.weight.shard_index)
    torch.testing.assert_close(y, expected.detach(), **TOL)
    local_probe = probe if gather else last_dim_chunk(probe, layer.weight.shard_index)
    (y * local_probe).sum().backward()
    torch.testing.assert_close(x.grad, seq_chunk(x_full.grad, sp), **TOL)
    assert_grads_match(layer.weight, ref.weight.grad, "column weight")
    if bias:
        assert_grads_match(layer.bias, ref.bias.grad, "column bias")
    # same seed -> the shard is the slice of the unsharded layer, padding rows zero
    tp_rank, tp_size = tp_info()
    expected_w = last_dim_chunk(ref.weight.detach().T, contiguous_shard_index(out_size, tp_rank, tp_size)).T
    assert torch.equal(layer.weight.detach(), expected_w)


def check_row(in_size: int, bias: bool, input_is_parallel: bool, sp: bool) -> None:
    torch.manual_seed(5)
    ref = nn.Linear(in_size, H, bias=bias)
    torch.manual_seed(5)
    layer = RowParallelLinear(in_size, H, bias=bias, input_is_parallel=input_is_parallel, sequence_parallel_enabled=sp)
    ref, layer, x_full = on_device(ref, layer, torch.randn(B, S, in_size, generator=torch.Generator().manual_seed(2)))
    x_full.requires_grad_(True)
    y_ref = ref(x_full)
    (probe,) = on_device(torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4)))
    (y_ref * probe).sum().backward()

    index = layer.weight.shard_index
    x_in = last_dim_chunk(x_full.detach(), index) if input_is_parallel else x_full.detach()
    x = x_in.clone().requires_grad_(True)
    y = layer(x)
    torch.testing.assert_close(y, seq_chunk(y_ref, sp).detach(), **TOL)
    (y * seq_chunk(probe, sp)).sum().backward()
    expected_dx = last_dim_chunk(x_full.grad, index) if input_is_parallel else x_full.grad
    torch.testing.assert_close(x.grad, expected_dx, **TOL)
    assert_grads_match(layer.weight, ref.weight.grad, "row weight")
    if bias:
        grad = layer.bias.grad.clone()
        if sp:  # replicated bias sees only this rank's sequence chunk
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        torch.testing.assert_close(grad, ref.bias.grad, **TOL)


def check_embedding(vocab: int, padding_idx, sp: bool) -> None:
    torch.manual_seed(11)
    ref = nn.Embedding(vocab, H, padding_idx=padding_idx)
    torch.manual_seed(11)
    layer = ParallelEmbedding(vocab, H, padding_idx=padding_idx, sequence_parallel_enabled=sp)
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(6))
    ids[0, :3] = 0  # padding_idx rows present
    ref, layer, ids = on_device(ref, layer, ids)
    y_ref = ref(ids)
    (probe,) = on_device(torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(8)))
    (y_ref * probe).sum().backward()
    y = layer(ids)
    torch.testing.assert_close(y, seq_chunk(y_ref, sp).detach(), **TOL)
    (y * seq_chunk(probe, sp)).sum().backward()  # SP: the reduce-scatter's backward gathers the sequence
    assert_grads_match(layer.weight, ref.weight.grad, "embedding weight")


def check_gqa(num_heads: int, num_kv_heads: int, fuse: bool, gather: bool, sp: bool) -> None:
    head_dim, bias = 4, True
    _, tp_size = tp_info()
    m = auto_kv_size_multiplier(num_heads, num_kv_heads, tp_size)
    torch.manual_seed(13)
    q_ref, k_ref, v_ref = (nn.Linear(H, n * head_dim, bias=bias) for n in (num_heads, num_kv_heads, num_kv_heads))
    torch.manual_seed(13)
    layer = GQAQKVColumnParallelLinear(
        H, [num_heads * head_dim, num_kv_heads * head_dim], bias=bias, gather_output=gather,
        sequence_parallel_enabled=sp, kv_size_multiplier=m, fuse_qkv=fuse, head_dim=head_dim,
    )
    q_ref, k_ref, v_ref, layer, x_full = on_device(q_ref, k_ref, v_ref, layer, _inputs(3))
    x_full.requires_grad_(True)
    refs = [q_ref(x_full), k_ref(x_full), v_ref(x_full)]
    g = torch.Generator().manual_seed(9)
    probes = on_device(*(torch.randn(r.shape, generator=g) for r in refs))
    sum((r * p).sum() for r, p in zip(refs, probes)).backward()

    x = sharded_input(x_full, sp)
    outs = layer(x)
    indices = [layer.q_shard_index, layer.kv_shard_index, layer.kv_shard_index]
    total = 0
    for out, r, p, index in zip(outs, refs, probes, indices):
        expected = r if gather else last_dim_chunk(r, index)
        torch.testing.assert_close(out, expected.detach(), **TOL)
        local_probe = p if gather else last_dim_chunk(p, index)
        if not gather and index is not layer.q_shard_index:
            # K/V copies: the reference gradient flows once per logical row; split the probe
            # over the copies so their summed contribution equals the reference's
            local_probe = local_probe / m
        total = total + (out * local_probe).sum()
    total.backward()
    torch.testing.assert_close(x.grad, seq_chunk(x_full.grad, sp), **TOL)
    if fuse:
        weight_ref = torch.cat([q_ref.weight.grad, k_ref.weight.grad, v_ref.weight.grad])
        bias_ref = torch.cat([q_ref.bias.grad, k_ref.bias.grad, v_ref.bias.grad])
        assert_grads_match(layer.weight_qkv, weight_ref, "qkv weight")
        assert_grads_match(layer.bias_qkv, bias_ref, "qkv bias")
    else:
        for name, ref in zip("qkv", (q_ref, k_ref, v_ref)):
            assert_grads_match(getattr(layer, f"weight_{name}"), ref.weight.grad, f"{name} weight")
            assert_grads_match(getattr(layer, f"bias_{name}"), ref.bias.grad, f"{name} bias")


TP = pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")


def _cases(names: str, values) -> pytest.MarkDecorator:
    """One parametrized case per tuple, its id the field=value pairs (flags by name when true)."""
    def case_id(case):
        parts = [(k if v else f"no_{k}") if isinstance(v, bool) else f"{k}{v}" for k, v in zip(names.split(","), case)]
        return "-".join(parts)
    values = list(values)
    return pytest.mark.parametrize(names, values, ids=[case_id(v) for v in values])


@TP
def test_sequence_parallel_indivisible_sequence_names_the_fix(ranks4, tp):
    ranks4.run(check_sp_sequence_error, model_parallel=(tp, 1))


@_cases("out,gather,bias,sp", [(o, g, b, sp) for sp, b in itertools.product((False, True), (False, True))
                               for o, g in ((8, True), (8, False), (10, True), (10, False))])
@TP
def test_column_parallel_linear_matches_nn_linear(ranks4, tp, out, gather, bias, sp):
    ranks4.run(check_column, out, bias, gather, sp, model_parallel=(tp, 1))


@_cases("in_,input_is_parallel,bias,sp", [(i, par, b, sp) for sp, b in itertools.product((False, True), (False, True))
                                          for i, par in ((8, True), (10, True), (8, False), (10, False))
                                          if par or not sp])
@TP
def test_row_parallel_linear_matches_nn_linear(ranks4, tp, in_, input_is_parallel, bias, sp):
    ranks4.run(check_row, in_, bias, input_is_parallel, sp, model_parallel=(tp, 1))


@_cases("sp,padding_idx,vocab", itertools.product((False, True), (None, 0), (16, 11)))
@TP
def test_parallel_embedding_matches_nn_embedding(ranks4, tp, sp, padding_idx, vocab):
    ranks4.run(check_embedding, vocab, padding_idx, sp, model_parallel=(tp, 1))


@_cases("heads,kv_heads,fuse,gather,sp", [(h, kv, f, g, sp) for (h, kv), f, g, sp in itertools.product(
    ((8, 2), (6, 2), (4, 4), (3, 1), (6, 6)), (True, False), (True, False), (False, True))])
@TP
def test_gqa_qkv_linear_matches_three_linears(ranks4, tp, heads, kv_heads, fuse, gather, sp):
    ranks4.run(check_gqa, heads, kv_heads, fuse, gather, sp, model_parallel=(tp, 1))


def test_layers_without_distributed_are_tp1():
    parallel_state.destroy_model_parallel()
    check_column(10, True, True, False)
    check_row(10, True, False, False)
    check_embedding(11, 0, False)


@pytest.mark.parametrize("heads,kv_heads,tp,m", [(6, 2, 4, 2), (8, 2, 4, 2), (12, 4, 8, 2), (4, 1, 4, 4), (8, 8, 4, 1), (6, 6, 4, 1)])
def test_gqa_layout_queries_read_their_kv_head(heads, kv_heads, tp, m):
    """Every real local query head's local K/V head (HF repeat_kv grouping) is its true K/V head."""
    group = heads // kv_heads
    seen = []
    for rank in range(tp):
        q_rows, kv_rows, padded = gqa_layout(heads, kv_heads, 1, m, rank, tp)
        local_group = len(q_rows) // len(kv_rows)
        for j, q in enumerate(q_rows.tolist()):
            if q >= 0:
                assert kv_rows[j // local_group] == q // group
                assert heads != kv_heads or kv_rows[j] == q  # MHA: padded alike
                seen.append(q)
        assert padded % tp == 0
    assert sorted(seen) == list(range(heads))


def test_gqa_layout_bad_multiplier_names_the_fix():
    with pytest.raises(ValueError, match="kv_size_multiplier=2"):
        gqa_layout(8, 2, 4, 1, 0, 4)


def test_move_model_to_device_keeps_sharding_metadata():
    layer = ColumnParallelLinear(4, 6)
    moved = move_model_to_device(nn.Sequential(layer), torch.device("cpu"))
    assert moved[0].weight.tensor_model_parallel and moved[0].weight.partition_dim == 0
    assert torch.equal(moved[0].weight.shard_index, torch.arange(6))


def test_shard_index_runs_match_a_row_by_row_scan():
    """The loader reads contiguous runs of a shard's rows; padding (-1) runs become zeros."""
    from nxd_hf.checkpoint.hf_safetensors import row_runs

    def scan(values):
        runs = []
        for v in values:
            if runs and v < 0 and runs[-1][2]:
                runs[-1] = (0, runs[-1][1] + 1, True)
            elif runs and v >= 0 and not runs[-1][2] and runs[-1][1] == v:
                runs[-1] = (runs[-1][0], v + 1, False)
            else:
                runs.append((0, 1, True) if v < 0 else (v, v + 1, False))
        return runs

    g = torch.Generator().manual_seed(0)
    cases = [[], [-1], [5], [0, 1, 2, -1, -1], [3, 4, 0, 1, -1, 7, 8], [2, 2, 3]]
    cases += [torch.randint(-1, 6, (int(n),), generator=g).tolist() for n in torch.randint(0, 12, (200,), generator=g)]
    for shard_index in [contiguous_shard_index(10, r, 4) for r in range(4)]:
        cases.append(shard_index.tolist())
    for values in cases:
        assert row_runs(torch.tensor(values, dtype=torch.long)) == scan(values), values
