"""Gradient sync and clipping against a single-process reference built from the same weights:
bucketed DP averaging, the whole-model grad norm with sharded, padded, replicated and
K/V-replicated parameters, and the sequence-parallel all-reduce of replicated grads."""

import math

import pytest
import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.backend import count_comm
from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear
from nxd_hf.parallel_layers.grads import allreduce_sequence_parallel_gradients, clip_grad_norm, sync_data_parallel_grads
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.parallel_layers.sharding import full_tensor, is_sharded, local_shard, mark_partial_grad_over_tp

VOCAB, HIDDEN, FFN = 11, 4, 6  # VOCAB 11 and FFN 6 are padded at tp 2 / tp 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_SIZE_MULTIPLIER = 4, 1, 4, 4
TOL = dict(rtol=1e-4, atol=1e-5)


def _full_grad(param: torch.Tensor) -> torch.Tensor:
    """The unsharded gradient of ``param`` (every rank gets it)."""
    return full_tensor(param, param.grad)


def _local(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the unsharded ``full`` (zeros at padding rows)."""
    return local_shard(param, full)


def _load(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(_local(param, full))


def _check_grads(pairs, case) -> None:
    """Local grad == this rank's slice of the reference grad, and the gathered grad == it."""
    for name, param, ref_grad in pairs:
        torch.testing.assert_close(param.grad, _local(param, ref_grad), **TOL, msg=lambda m: f"{case} {name} {m}")
        torch.testing.assert_close(_full_grad(param), ref_grad, **TOL, msg=lambda m: f"{case} {name} full {m}")


# -- data-parallel sync


class _SmallModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = ParallelEmbedding(VOCAB, HIDDEN)
        self.up = ColumnParallelLinear(HIDDEN, FFN, gather_output=False)
        self.down = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.embed(ids))))


class _SmallReference(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.embed(ids))))


# Grad bytes [embed.w, up.w, up.b, down.w, down.b]: tp 1: 176 96 24 96 16; tp 2: 96 48 12 48 16.
# A 120-byte bucket closes before the tensor that would overflow it, so both make 3 buckets
# (tp 1: [176] [96 24] [96 16]; tp 2: [96] [48 12 48] [16]).
BUCKETS = [(25, 1), (120 / 2**20, 3), (1e-9, 5)]  # (bucket_size_mb, expected all-reduces)


def _check_dp_sync(case: str) -> None:
    dp_size, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    assert dp_size == 2
    torch.manual_seed(0)
    ref = _SmallReference()
    torch.manual_seed(0)
    model = _SmallModel()
    for name, param in model.named_parameters():  # same seed, same weights: the slices of the reference
        torch.testing.assert_close(_local(param, ref.get_parameter(name).detach()), param.detach(), rtol=0, atol=0)

    g = torch.Generator().manual_seed(1)
    batch = 4
    ids = torch.randint(0, VOCAB, (batch, 3), generator=g)
    probe = torch.randn(batch, 3, HIDDEN, generator=g)
    ((ref(ids) * probe).sum() / batch).backward()  # mean over samples of each sample's weighted sum
    pairs = [(name, p, ref.get_parameter(name).grad) for name, p in model.named_parameters()]

    half = slice(dp_rank * batch // dp_size, (dp_rank + 1) * batch // dp_size)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for bucket_size_mb, num_buckets in BUCKETS:
        model.zero_grad()
        ((model(ids[half]) * probe[half]).sum() / (batch // dp_size)).backward()
        with count_comm() as records:
            sync_data_parallel_grads(model.parameters(), bucket_size_mb=bucket_size_mb)
        assert len(records) == num_buckets, (case, bucket_size_mb, records)
        assert all(r.op == "all_reduce" and r.group_size == dp_size for r in records), records
        assert sum(r.payload_bytes for r in records) == grad_bytes, records
        _check_grads(pairs, f"{case} bucket {bucket_size_mb} MB")


# -- clip_grad_norm


class _ClipModel(nn.Module):
    """Sharded, padded, replicated (row bias, LayerNorm) and replicated-K/V parameters."""

    def __init__(self, fuse_qkv: bool):
        super().__init__()
        self.embed = ParallelEmbedding(VOCAB, HIDDEN)
        self.qkv = GQAQKVColumnParallelLinear(
            HIDDEN, [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], gather_output=True,
            kv_size_multiplier=KV_SIZE_MULTIPLIER, fuse_qkv=fuse_qkv, head_dim=HEAD_DIM,
        )
        self.up = ColumnParallelLinear(NUM_HEADS * HEAD_DIM, FFN, gather_output=False)
        self.down = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids))
        return self.norm(self.down(torch.tanh(self.up(_mix(q, k, v)))))


class _ClipReference(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.q = nn.Linear(HIDDEN, NUM_HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM)
        self.up = nn.Linear(NUM_HEADS * HEAD_DIM, FFN)
        self.down = nn.Linear(FFN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids):
        h = self.embed(ids)
        return self.norm(self.down(torch.tanh(self.up(_mix(self.q(h), self.k(h), self.v(h))))))


def _mix(q, k, v):
    """A stand-in for attention: every query head meets the K/V head of its group."""
    groups = NUM_HEADS // NUM_KV_HEADS

    def expand(x):  # [b, s, kv_heads * d] -> [b, s, heads * d], HF's repeat_kv order
        return x.unflatten(-1, (NUM_KV_HEADS, 1, HEAD_DIM)).expand(-1, -1, -1, groups, -1).flatten(-3)

    return q * expand(k) + expand(v)


def _clip_pairs(model: _ClipModel, ref: _ClipReference, fuse_qkv: bool):
    """(name, parallel param, reference params whose concatenation is its unsharded tensor)."""
    qkv = model.qkv
    if fuse_qkv:
        q_k_v = [("qkv.weight", qkv.weight_qkv, [ref.q.weight, ref.k.weight, ref.v.weight]),
                 ("qkv.bias", qkv.bias_qkv, [ref.q.bias, ref.k.bias, ref.v.bias])]
    else:
        q_k_v = [(f"qkv.{kind}_{n}", getattr(qkv, f"{kind}_{n}"), [getattr(getattr(ref, n), kind)])
                 for n in "qkv" for kind in ("weight", "bias")]
    plain = [(name, p, [ref.get_parameter(name)])
             for name, p in model.named_parameters() if not name.startswith("qkv.")]
    pairs = plain + q_k_v
    assert len(pairs) == len(list(model.parameters()))
    return pairs


def _check_clip(fuse_qkv: bool, norm_type: float, case: str) -> None:
    torch.manual_seed(0)
    ref = _ClipReference()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)
        ref.norm.bias.uniform_(-0.5, 0.5)
    model = _ClipModel(fuse_qkv)
    pairs = _clip_pairs(model, ref, fuse_qkv)
    for _, param, refs in pairs:
        _load(param, torch.cat([r.detach() for r in refs]))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 3), generator=g)
    probe = torch.randn(2, 3, HIDDEN, generator=g)
    out, ref_out = model(ids), ref(ids)
    torch.testing.assert_close(out, ref_out, **TOL)
    (out * probe).sum().backward()
    (ref_out * probe).sum().backward()
    grad_pairs = [(name, p, torch.cat([r.grad for r in refs])) for name, p, refs in pairs]
    _check_grads(grad_pairs, f"{case} before clipping")  # each K/V copy holds the unreplicated grad

    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
    max_norm = ref_norm.item() / 4  # clipping really scales, by about 1/4
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    total = clip_grad_norm(model.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, ref_total, **TOL, msg=lambda m: f"{case} norm {m}")
    grad_pairs = [(name, p, torch.cat([r.grad for r in refs])) for name, p, refs in pairs]
    _check_grads(grad_pairs, f"{case} after clipping")


# -- sequence parallelism


def _check_sequence_parallel() -> None:
    tp_size, tp_rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    up_ref, down_ref = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    norm_ref, tail_ref = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        for norm in (norm_ref, tail_ref):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    up = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, sequence_parallel_enabled=True)
    down = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True, sequence_parallel_enabled=True)
    norm, tail = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)  # `tail` is not marked: its grad stays partial
    for p in norm.parameters():
        p.sequence_parallel_enabled = True  # NxD's name for the marking: an alias of partial_grad_over_tp
    mark_partial_grad_over_tp(up.weight)  # a sharded param is never summed, even if marked
    pairs = [("up.weight", up.weight, up_ref.weight), ("up.bias", up.bias, up_ref.bias),
             ("down.weight", down.weight, down_ref.weight), ("down.bias", down.bias, down_ref.bias),
             ("norm.weight", norm.weight, norm_ref.weight), ("norm.bias", norm.bias, norm_ref.bias),
             ("tail.weight", tail.weight, tail_ref.weight), ("tail.bias", tail.bias, tail_ref.bias)]
    for _, param, full in pairs:
        _load(param, full.detach())

    g = torch.Generator().manual_seed(1)
    seq = 4
    x, probe = torch.randn(2, seq, HIDDEN, generator=g), torch.randn(2, seq, HIDDEN, generator=g)
    chunk = slice(tp_rank * seq // tp_size, (tp_rank + 1) * seq // tp_size)
    (tail(norm(down(torch.tanh(up(x[:, chunk]))))) * probe[:, chunk]).sum().backward()  # [b, s/tp, h]
    (tail_ref(norm_ref(down_ref(torch.tanh(up_ref(x))))) * probe).sum().backward()

    sharded = [(n, p, r.grad) for n, p, r in pairs if is_sharded(p)]
    replicated = [(n, p, r.grad) for n, p, r in pairs if not is_sharded(p)]
    assert [n for n, _, _ in sharded] == ["up.weight", "up.bias", "down.weight"]
    _check_grads(sharded, "sp sharded before")
    for name, param, ref_grad in replicated:  # partial: this rank's sequence chunk only
        assert not torch.allclose(param.grad, ref_grad, **TOL), name
    tail_partial = [tail.weight.grad.clone(), tail.bias.grad.clone()]

    with count_comm() as records:
        allreduce_sequence_parallel_gradients([up.weight, up.bias, down.weight, down.bias, *norm.parameters(),
                                               *tail.parameters()])
    assert [(r.op, r.group_size, r.payload_bytes) for r in records] == [("all_reduce", tp_size, 3 * HIDDEN * 4)]
    _check_grads(sharded, "sp sharded after")  # untouched
    _check_grads([p for p in replicated if not p[0].startswith("tail.")], "sp replicated after")
    assert torch.equal(tail.weight.grad, tail_partial[0]) and torch.equal(tail.bias.grad, tail_partial[1])


# -- one pytest item per case on the rank pools


def test_dp_sync_averages_bucketed_grads_tp1_dp2(ranks2):
    ranks2.run(_check_dp_sync, "tp1 dp2", model_parallel=(1, 1))


def test_sequence_parallel_allreduce_sums_only_replicated_sp_grads_tp2(ranks2):
    ranks2.run(_check_sequence_parallel, model_parallel=(2, 1))


def test_dp_sync_averages_bucketed_grads_tp2_dp2(ranks4):
    ranks4.run(_check_dp_sync, "tp2 dp2", model_parallel=(2, 1))


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["fused_qkv", "separate_qkv"])
@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")
def test_clip_grad_norm_matches_whole_model_norm(ranks4, tp, fuse_qkv, norm_type):
    ranks4.run(_check_clip, fuse_qkv, norm_type, f"tp{tp} fuse_qkv={fuse_qkv} norm={norm_type}",
               model_parallel=(tp, 1))


def _check_clip_mixed_dtypes_tp1() -> None:
    """tp = 1: bf16 and fp32 gradients (one kernel group each) and a parameter without one; the
    norm in fp32 (as the fp64 norm of the same values), every gradient scaled by one coefficient."""
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g).to(dtype)) for dtype in
              (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)] + [torch.nn.Parameter(torch.zeros(2))]
    for p in params[:4]:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    before = [p.grad.double() for p in params[:4]]
    want = torch.cat([b.flatten() for b in before]).norm()
    total = clip_grad_norm(params, 0.5)
    assert total.dtype == torch.float32 and params[4].grad is None
    torch.testing.assert_close(total.double(), want, rtol=1e-6, atol=0)
    coef = 0.5 / (want + 1e-6)
    for p, b in zip(params[:4], before):
        torch.testing.assert_close(p.grad, (b * coef).to(p.dtype), rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-6,
                                   atol=0)


def test_clip_grad_norm_mixed_dtypes_tp1(ranks2):
    ranks2.run(_check_clip_mixed_dtypes_tp1, model_parallel=(1, 1))
