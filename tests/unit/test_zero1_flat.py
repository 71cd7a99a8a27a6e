"""ZeRO-1's flat layouts (``nxd_hf.optim.zero1.flat``), no processes: in the interleaved layout every
bucket is one contiguous flat range whose dp equal parts go to the DP ranks in order, parameters
lie in backward order (those summed over TP after backward last), and the ranks' pieces tile the
padded buffer exactly once, as they do in the contiguous layout."""

import pytest
import torch

from nxd_hf.optim.zero1.flat import build_flat_groups
from nxd_hf.parallel_layers.sharding import mark_partial_grad_over_tp


def _params():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 30, 5, 64, 3)]
    mark_partial_grad_over_tp(params[1])
    return params


def _groups(interleaved: bool, dp: int = 3):
    params = _params()
    return params, [build_flat_groups([{"params": params}], dp_size=dp, dp_rank=r, bucket_size_mb=10 * dp * 4 / 2**20,
                                      interleaved=interleaved)[0] for r in range(dp)]


@pytest.mark.parametrize("interleaved", [True, False])
def test_pieces_tile_the_padded_buffer(interleaved):
    _, fgs = _groups(interleaved)
    covered = torch.zeros(fgs[0].dp_size * fgs[0].shard_numel, dtype=torch.int64)
    for fg in fgs:
        shard = torch.zeros(fg.shard_numel, dtype=torch.int64)
        for lo, hi, at in fg.pieces():
            covered[lo:hi] += 1
            shard[at : at + hi - lo] += 1
        assert shard.eq(1).all()  # each rank's master slice filled once
        for i, p in enumerate(fg.params):  # param_pieces agree with the pieces
            for a, b, at in fg.param_pieces(i):
                assert any(lo <= fg.offsets[i] + a and fg.offsets[i] + b <= hi and at == s + fg.offsets[i] + a - lo
                           for lo, hi, s in fg.pieces())
    assert covered.eq(1).all()


def test_interleaved_buckets_are_contiguous_and_in_backward_order():
    params, fgs = _groups(True)
    fg = fgs[0]
    assert [p.numel() for p in fg.params] == [3, 64, 5, 7, 30]  # reversed; the partial one (30) last
    assert len(fg.buckets()) > 1
    for c0, c1 in fg.buckets():
        lo, hi = fg.bucket_range(c0, c1)
        assert [fg.row_start(r, c0, c1) for r in range(fg.dp_size)] == list(range(lo, hi, c1 - c0))
        members = fg.bucket_params(c0, c1)
        assert members == sorted(members) and members  # a range of consecutive parameters
        assert members == list(range(members[0], members[-1] + 1))


def test_contiguous_layout_keeps_the_parameter_order():
    params, fgs = _groups(False)
    assert [id(p) for p in fgs[0].params] == [id(p) for p in params]
    assert [fg.pieces() for fg in fgs] == [[(r * fgs[0].shard_numel, (r + 1) * fgs[0].shard_numel, 0)] for r in range(3)]
