"""Expert parallelism (issue 24 item 2): experts split over the expert-parallel group carved
from data parallelism, tokens dispatched by all-to-all, exact against the unparallelized HF
model (tests/moe_ep_cases.py)."""

import pytest

from moe_ep_cases import check_ep_training


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_world2_matches_hf(ranks2, model_type):
    ranks2.run(check_ep_training, model_type, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_dp4_matches_hf(ranks4, model_type):
    ranks4.run(check_ep_training, model_type, 2)
