"""Nothing for nothing at tp=1: one forward + backward of a parallelized tiny
llama on one rank dispatches no cast, copy or other aten op beyond the plain HF model's."""

from nxd_hf.testing import run_distributed

import op_count_cases


def test_tp1_dispatches_no_more_ops_than_plain_hf():
    run_distributed(op_count_cases.check_no_extra_work, 1)  # one rank: tp=1 and dp=1, as one GPU
