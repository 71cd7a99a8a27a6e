"""The expert-parallel groups of ``parallel_state.rank_lists``: carved from data parallelism
(consecutive blocks of ep DP indices per (pp, tp) position), pure arithmetic."""

import pytest

from nxd_hf import parallel_state
from nxd_hf.parallel_sizes import ParallelSizes


def test_ep2_dp4_world4():
    lists = parallel_state.rank_lists(ParallelSizes.for_world(4, tp=1, pp=1, ep=2))
    assert lists["expert"] == [[0, 1], [2, 3]]
    assert lists["expert_data"] == [[0, 2], [1, 3]]
    assert lists["data"] == [[0, 1, 2, 3]]


def test_ep_equal_dp_leaves_expert_data_singletons():
    lists = parallel_state.rank_lists(ParallelSizes.for_world(2, tp=1, pp=1, ep=2))
    assert lists["expert"] == [[0, 1]]
    assert lists["expert_data"] == [[0], [1]]


def test_ep_with_tp_and_pp_stays_inside_each_data_group():
    lists = parallel_state.rank_lists(ParallelSizes.for_world(16, tp=2, pp=2, ep=2))  # dp = 4
    # pp 0, tp 0: DP indices 0..3 are global ranks 0, 2, 4, 6
    assert [0, 2] in lists["expert"] and [4, 6] in lists["expert"]
    assert [0, 4] in lists["expert_data"] and [2, 6] in lists["expert_data"]
    data = {tuple(g) for g in lists["data"]}
    for group in lists["expert"] + lists["expert_data"]:
        assert any(set(group) <= set(d) for d in data), group


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 1, 1, 2), (8, 1, 1, 4), (8, 2, 1, 2), (16, 2, 2, 4), (8, 1, 2, 2)])
def test_expert_groups_partition_the_world(world, tp, pp, ep):
    lists = parallel_state.rank_lists(ParallelSizes.for_world(world, tp=tp, pp=pp, ep=ep))
    dp = world // (tp * pp)
    for kind, size in (("expert", ep), ("expert_data", dp // ep)):
        flat = sorted(r for g in lists[kind] for r in g)
        assert flat == list(range(world)), kind
        assert all(len(g) == size for g in lists[kind]), kind
    # an expert group and an expert_data group meet in exactly one rank when they share a data group
    for e in lists["expert"]:
        for d in lists["expert_data"]:
            shared = set(e) & set(d)
            assert len(shared) <= 1


def test_ep1_adds_no_groups():
    assert set(parallel_state.rank_lists(ParallelSizes.for_world(4, tp=2, pp=1))) == {"tensor", "data", "pipeline", "model"}
    assert parallel_state.rank_lists(ParallelSizes.for_world(4, tp=2, pp=1, ep=1)) == parallel_state.rank_lists(
        ParallelSizes.for_world(4, tp=2, pp=1))


@pytest.mark.parametrize("world,tp,ep", [(4, 1, 3), (6, 1, 4), (4, 2, 4)])
def test_ep_not_dividing_dp_is_a_value_error(world, tp, ep):
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        parallel_state.rank_lists(ParallelSizes.for_world(world, tp=tp, pp=1, ep=ep))


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_bad_expert_parallel_size(bad):
    with pytest.raises(ValueError, match="expert_parallel_size must be an int"):
        ParallelSizes(ep=bad, dp=2)


def test_uninitialized_defaults():
    assert parallel_state.get_expert_parallel_size() == 1
    assert parallel_state.get_expert_parallel_rank() == 0
    assert parallel_state.get_expert_data_parallel_size() == 1
    assert parallel_state.get_expert_data_parallel_rank() == 0
