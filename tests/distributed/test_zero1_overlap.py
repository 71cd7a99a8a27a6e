"""ZeRO-1's reduce-scatter starts per bucket during backward (counted through the
real gradient hooks and collectives) and steps bitwise as the reduce-scatter in ``step()``, at dp=2
and tp=2 x dp=2 (sequence parallelism: norms' gradients summed over TP after backward), with
accumulation under ``no_sync``; old contiguous-layout ``state_dict``s still load."""

import pytest

import zero1_overlap_cases as cases


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overlap_matches_step_reduce_scatter_dp2(ranks2, accumulate):
    ranks2.run(cases.check_overlap_matches_step_reduce_scatter, False, accumulate, model_parallel=(1, 1))


def test_step_without_new_backward_reduces_again_dp2(ranks2):
    ranks2.run(cases.check_step_without_new_backward_reduces_again, model_parallel=(1, 1))


def test_contiguous_state_dict_loads_into_interleaved_dp2(ranks2):
    ranks2.run(cases.check_contiguous_state_dict_loads_into_interleaved, model_parallel=(1, 1))


@pytest.mark.parametrize("sp", [False, True])
def test_overlap_matches_step_reduce_scatter_tp2_dp2(ranks4, sp):
    ranks4.run(cases.check_overlap_matches_step_reduce_scatter, sp, 2, model_parallel=(2, 1))
