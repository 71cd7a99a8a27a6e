"""ZeRO-1 with expert parallelism (issue 24): expert parameters' gradients, optimizer state and
master slices sharded over the expert-data group, the rest over the data group; exact against
single-process HF with AdamW and clipping (tests/moe_zero1_cases.py)."""

import pytest

from moe_zero1_cases import check_zero1_ep_training


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_zero1_ep2_world2_matches_hf(ranks2, model_type):
    ranks2.run(check_zero1_ep_training, model_type, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_zero1_ep2_dp4_matches_hf(ranks4, model_type):
    ranks4.run(check_zero1_ep_training, model_type, 2)


def test_zero1_ep2_through_the_config_api(ranks2):
    ranks2.run(check_zero1_ep_training, "qwen3_moe", 2, True)
