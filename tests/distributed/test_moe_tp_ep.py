"""Tensor x expert parallelism (issue 24): experts split over EP (all-to-all dispatch outermost) and
their intermediate dims over TP inside, at world 4 = tp 2 x dp 2 carved into one ep=2 block, exact
against the unparallelized HF model (tests/moe_tp_ep_cases.py)."""

import pytest

from moe_tp_ep_cases import tp_ep_training_matches_hf

MODEL_TYPES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("sp,aux", [(False, False), (True, True)], ids=["distinct_batches", "sp_aux_loss"])
def test_tp2_ep2_matches_hf(ranks4, model_type, sp, aux):
    """Loss, aux loss (output_router_logits; the same batch on both replicas), every gathered
    gradient over 3 AdamW steps, eval logits; SP with the aux loss, distinct batches per replica without."""
    result = ranks4.run(tp_ep_training_matches_hf, model_type, 2, 2, sp, aux)[0]
    assert result["both_sharded"], "the experts must be sharded over both TP and EP"
    if aux and model_type != "deepseek_v3":  # DeepSeek-V3 has no aux loss (bias-corrected routing)
        assert len(result["aux_losses"]) == 3
