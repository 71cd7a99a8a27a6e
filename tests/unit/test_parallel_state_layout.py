"""parallel_state in one process: the [PP, DP, TP] rank layout (pure arithmetic) and the
uninitialized defaults (every getter acts as a single process). The groups on 8 gloo ranks:
tests/distributed/test_parallel_state.py."""

import pytest
import torch
import torch.distributed as dist

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_sizes import ParallelSizes


# -- rank_lists: pure layout arithmetic


def test_rank_lists_world8_tp2_pp2():
    lists = parallel_state.rank_lists(ParallelSizes.for_world(8, tp=2, pp=2))
    assert lists == {
        "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "model": [[0, 1, 4, 5], [2, 3, 6, 7]],
    }


def test_rank_lists_tp_only_and_dp_only():
    assert parallel_state.rank_lists(ParallelSizes.for_world(4, tp=4, pp=1)) == {
        "tensor": [[0, 1, 2, 3]],
        "data": [[0], [1], [2], [3]],
        "pipeline": [[0], [1], [2], [3]],
        "model": [[0, 1, 2, 3]],
    }
    assert parallel_state.rank_lists(ParallelSizes.for_world(4, tp=1, pp=1)) == {
        "tensor": [[0], [1], [2], [3]],
        "data": [[0, 1, 2, 3]],
        "pipeline": [[0], [1], [2], [3]],
        "model": [[0], [1], [2], [3]],
    }


def test_rank_lists_pp_outermost_tp_contiguous():
    lists = parallel_state.rank_lists(ParallelSizes.for_world(16, tp=2, pp=4))  # dp = 2
    assert lists["tensor"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert lists["pipeline"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lists["data"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lists["model"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (12, 3, 2), (6, 1, 3), (1, 1, 1), (24, 2, 3)])
def test_rank_lists_every_kind_partitions_the_world(world, tp, pp):
    dp = world // (tp * pp)
    sizes = {"tensor": tp, "data": dp, "pipeline": pp, "model": tp * pp}
    for kind, groups in parallel_state.rank_lists(ParallelSizes.for_world(world, tp=tp, pp=pp)).items():
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == sizes[kind] for g in groups), kind
        assert len(groups) == world // sizes[kind], kind


@pytest.mark.parametrize("world,tp,pp", [(8, 3, 1), (8, 2, 3), (6, 4, 1), (8, 16, 1)])
def test_rank_lists_indivisible_world_raises(world, tp, pp):
    with pytest.raises(ValueError, match=rf"world size {world}.*\({tp}\).*\({pp}\)"):
        parallel_state.rank_lists(ParallelSizes.for_world(world, tp=tp, pp=pp))


def test_rank_lists_zero_size_raises():
    with pytest.raises(ValueError):
        parallel_state.rank_lists(ParallelSizes.for_world(8, tp=0, pp=1))
    with pytest.raises(ValueError):
        parallel_state.rank_lists(ParallelSizes.for_world(8, tp=1, pp=0))


# -- nothing initialized: a single process


def test_getters_uninitialized_act_as_single_process():
    if dist.is_initialized():  # an earlier test in this process ran a single-process world
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert not parallel_state.model_parallel_is_initialized()
    ps = parallel_state
    for getter in (
        ps.get_tensor_model_parallel_size, ps.get_tensor_parallel_size, ps.get_tensor_model_parallel_world_size,
        ps.get_pipeline_model_parallel_size, ps.get_pipeline_parallel_size, ps.get_pipeline_model_parallel_world_size,
        ps.get_data_parallel_size, ps.get_data_parallel_world_size,
    ):
        assert getter() == 1, getter.__name__
    for getter in (
        ps.get_tensor_model_parallel_rank, ps.get_tensor_parallel_rank, ps.get_pipeline_model_parallel_rank,
        ps.get_pipeline_parallel_rank, ps.get_data_parallel_rank, ps.get_model_parallel_rank,
        ps.get_tensor_model_parallel_src_rank,
    ):
        assert getter() == 0, getter.__name__
    for getter in (
        ps.get_tensor_model_parallel_group, ps.get_tensor_parallel_group, ps.get_pipeline_model_parallel_group,
        ps.get_pipeline_parallel_group, ps.get_data_parallel_group, ps.get_model_parallel_group,
    ):
        group = getter()
        assert group is backend.SELF and backend.group_size(group) == 1, getter.__name__
        assert getter(as_list=True) == [[0]], getter.__name__
    # collectives on the uninitialized groups are no-ops, not errors
    t = torch.tensor([3.0])
    assert backend.all_reduce(t, ps.get_data_parallel_group()) is t and t.item() == 3.0
    assert ps.rmsg("hi") == "[rank 0 tp 0 pp 0 dp 0] hi"
