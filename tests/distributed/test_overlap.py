"""Each bucket's data-parallel all-reduce starts during backward; the
gradients are bitwise those of the all-reduce after backward, at dp=2 and tp=2 x dp=2, with
sequence parallelism (partial gradients summed over TP), a tied head and accumulation under
``no_sync``."""

import pytest

import overlap_cases


@pytest.mark.parametrize("sp,tie,accumulate", [(False, False, False), (False, True, True)])
def test_overlap_bitwise_dp2(ranks2, sp, tie, accumulate):
    ranks2.run(overlap_cases.check_overlap_matches_reduction_after_backward, sp, tie, accumulate,
               model_parallel=(1, 1))


def test_one_bucket_dp2(ranks2):
    ranks2.run(overlap_cases.check_one_bucket_of_everything, model_parallel=(1, 1))


@pytest.mark.parametrize("sp,tie,accumulate", [(False, False, False), (True, True, True)])
def test_overlap_bitwise_tp2_dp2(ranks4, sp, tie, accumulate):
    ranks4.run(overlap_cases.check_overlap_matches_reduction_after_backward, sp, tie, accumulate,
               model_parallel=(2, 1))


def test_heap_trimmed_before_the_head(ranks2):
    ranks2.run(overlap_cases.check_heap_trimmed_before_the_head, model_parallel=(2, 1))
