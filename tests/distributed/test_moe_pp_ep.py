"""Pipeline x expert parallelism (issue 24): pp=2 x ep=2 on 4 ranks against the unparallelized HF
model (cases in tests/moe_pp_ep_cases.py)."""

import pytest

import moe_pp_ep_cases as cases


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_pp2_ep2_matches_hf(ranks4, model_type):
    result = ranks4.run(cases.pipeline_ep_matches_hf, model_type)[0]
    assert result["exchanges"] > 0
    assert (len(result["aux"]) > 0) == (model_type != "deepseek_v3")
