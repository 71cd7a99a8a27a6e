"""``ParallelSizes``: the one frozen, validated value of the parallel layout (no processes)."""

import dataclasses

import pytest

from nxd_hf.parallel_sizes import ParallelSizes


def test_for_world_puts_the_rest_in_dp_and_is_frozen():
    sizes = ParallelSizes.for_world(8, tp=2, pp=2, ep=2)
    assert (sizes.tp, sizes.pp, sizes.dp, sizes.ep, sizes.world, sizes.model_parallel) == (2, 2, 2, 2, 8, 4)
    assert sizes.as_dict() == {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "cp": 1, "world": 8}
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.tp = 4
    assert dataclasses.replace(sizes, ep=1) == ParallelSizes.for_world(8, tp=2, pp=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, "auto"])
def test_a_size_that_is_not_a_positive_int_is_named(bad):
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 1, got .*pass e\.g\."):
        ParallelSizes.for_world(4, tp=bad)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int"):
        ParallelSizes(pp=bad)


def test_world_not_divisible_and_ep_not_dividing_dp():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible .*\(4\)"):
        ParallelSizes.for_world(6, tp=4)
    with pytest.raises(ValueError, match="must divide the data-parallel size 2"):
        ParallelSizes.for_world(4, tp=2, ep=4)
    with pytest.raises(ValueError, match=r"context_parallel_size \(4\) must divide the data-parallel size 2"):
        ParallelSizes.for_world(4, tp=2, cp=4)
    assert ParallelSizes.for_world(8, tp=2, cp=2).world == 8  # carved from dp: not a factor of the world


def test_one_definition_of_the_layout_value():
    """The model's state, the process groups and the plan's layouts hold the same value."""
    from nxd_hf import parallel_state
    from nxd_hf.model_state import NxDModelState
    from nxd_hf.plan.layout import Layout

    assert parallel_state.get_parallel_sizes() == ParallelSizes()
    assert {f.type for f in dataclasses.fields(NxDModelState) if f.name == "sizes"} == {ParallelSizes}
    assert Layout(sizes=ParallelSizes(tp=2, dp=4), num_microbatches=1).dp == 4
