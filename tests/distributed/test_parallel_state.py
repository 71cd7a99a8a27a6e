"""parallel_state: every getter and group on 8 gloo ranks for many (tp, pp) layouts (the rank
layout arithmetic and the uninitialized defaults: tests/unit/test_parallel_state_layout.py)."""

import pytest
import torch
import torch.distributed as dist

from nxd_hf import backend, parallel_state

WORLD_SIZE = 8
LAYOUTS = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (2, 4), (1, 2)]  # (tp, pp)


# -- every getter and group on 8 ranks


def _expected(rank: int, tp: int, pp: int) -> dict:
    """This rank's coordinates and groups, computed from the layout formula (not rank_lists)."""
    dp = WORLD_SIZE // (tp * pp)
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)

    def at(p_, d_, t_):
        return (p_ * dp + d_) * tp + t_

    return {
        "dp": dp, "tp_rank": t, "dp_rank": d, "pp_rank": p,
        "tensor": [at(p, d, i) for i in range(tp)],
        "data": [at(p, i, t) for i in range(dp)],
        "pipeline": [at(i, d, t) for i in range(pp)],
        "model": sorted(at(i, d, j) for i in range(pp) for j in range(tp)),
        "all": {
            "tensor": sorted(tuple(at(a, b, i) for i in range(tp)) for a in range(pp) for b in range(dp)),
            "data": sorted(tuple(at(a, i, c) for i in range(dp)) for a in range(pp) for c in range(tp)),
            "pipeline": sorted(tuple(at(i, b, c) for i in range(pp)) for b in range(dp) for c in range(tp)),
            "model": sorted(tuple(sorted(at(i, b, j) for i in range(pp) for j in range(tp))) for b in range(dp)),
        },
    }


def _members(group) -> list[int]:
    """Which global ranks an all-reduce over ``group`` really sums (one-hot per rank)."""
    onehot = torch.zeros(WORLD_SIZE)
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    assert set(onehot.tolist()) <= {0.0, 1.0}, onehot
    return [r for r in range(WORLD_SIZE) if onehot[r] == 1.0]


def _check_layout(tp: int, pp: int) -> tuple[int, int, int]:
    """Every getter at (tp, pp) on this rank; its (pp, dp, tp) coordinate."""
    ps = parallel_state
    rank = dist.get_rank()
    ps.initialize_model_parallel(tp, pp)
    assert ps.model_parallel_is_initialized()
    exp = _expected(rank, tp, pp)
    case = (tp, pp)
    assert ps.get_tensor_model_parallel_size() == ps.get_tensor_parallel_size() == tp, case
    assert ps.get_tensor_model_parallel_world_size() == tp, case
    assert ps.get_pipeline_model_parallel_size() == ps.get_pipeline_parallel_size() == pp, case
    assert ps.get_pipeline_model_parallel_world_size() == pp, case
    assert ps.get_data_parallel_size() == ps.get_data_parallel_world_size() == exp["dp"], case
    assert ps.get_tensor_model_parallel_rank() == ps.get_tensor_parallel_rank() == exp["tp_rank"], case
    assert ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_parallel_rank() == exp["pp_rank"], case
    assert ps.get_data_parallel_rank() == exp["dp_rank"], case
    assert ps.get_model_parallel_rank() == exp["model"].index(rank), case
    assert ps.get_tensor_model_parallel_src_rank() == exp["tensor"][0], case
    assert ps.rmsg("m") == f"[rank {rank} tp {exp['tp_rank']} pp {exp['pp_rank']} dp {exp['dp_rank']}] m"
    getters = {
        "tensor": (ps.get_tensor_model_parallel_group, ps.get_tensor_parallel_group),
        "data": (ps.get_data_parallel_group,),
        "pipeline": (ps.get_pipeline_model_parallel_group, ps.get_pipeline_parallel_group),
        "model": (ps.get_model_parallel_group,),
    }
    for kind, spellings in getters.items():
        for getter in spellings:
            group = getter()
            assert backend.group_size(group) == len(exp[kind]), (case, kind)
            assert _members(group) == exp[kind], (case, kind, getter.__name__)
            as_list = getter(as_list=True)
            assert sorted(tuple(g) for g in as_list) == exp["all"][kind], (case, kind)
            assert exp[kind] in [sorted(g) for g in as_list], (case, kind)
    return exp["pp_rank"], exp["dp_rank"], exp["tp_rank"]


def _check_indivisible_size_then_usable_and_destroyed():
    ps = parallel_state
    rank = dist.get_rank()
    ps.initialize_model_parallel(1, 2)  # an error and a re-initialization over existing groups
    with pytest.raises(ValueError, match=r"world size 8.*\(3\)"):
        ps.initialize_model_parallel(3, 1)
    ps.initialize_model_parallel(2, 2)  # usable again after the error
    assert _members(ps.get_data_parallel_group()) == _expected(rank, 2, 2)["data"]
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_size() == ps.get_data_parallel_size() == 1
    assert ps.get_data_parallel_group() is backend.SELF


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}_pp{pp}" for tp, pp in LAYOUTS])
def test_groups_and_getters_world8(ranks8, tp, pp):
    dp = WORLD_SIZE // (tp * pp)
    seen = sorted(ranks8.run(_check_layout, tp, pp))
    # every (pp, dp, tp) coordinate is held by exactly one rank
    assert seen == [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]


def test_indivisible_world_raises_then_groups_are_usable_and_destroyed_world8(ranks8):
    ranks8.run(_check_indivisible_size_then_usable_and_destroyed)
