"""Experts sharded over TP (HF's "moe_tp_experts", ``nxd_hf.moe.tp_experts``): tiny Mixtral,
Qwen3-MoE, DeepSeek-V3 (shared experts, routed scaling) and gpt-oss (expert biases, sinks,
interleaved clamped SwiGLU) at tp=2 and tp=4, with and without sequence parallelism, against the
unparallelized HF model: loss, the aux loss with output_router_logits, every gathered gradient,
three AdamW steps, eval logits."""

import pytest

from moe_cases import identity_experts_match, moe_checkpoints_round_trip, moe_trainer_matches_hf, moe_training_matches_hf

# DeepSeek-V3's attention (MLA) stays replicated in HF's plan, so it runs without SP.
CASES = [("mixtral", False), ("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True),
         ("deepseek_v3", False), ("gpt_oss", False), ("gpt_oss", True)]


@pytest.mark.parametrize("model_type,sp", CASES)
def test_moe_tp2_matches_hf(ranks2, model_type, sp):
    result = ranks2.run(moe_training_matches_hf, model_type, 2, sp)[0]
    assert result["sharded"], "the experts must be sharded over TP"
    if model_type != "deepseek_v3":  # DeepSeek-V3 has no aux loss (bias-corrected routing)
        assert len(result["aux_losses"]) == 3


@pytest.mark.parametrize("model_type,sp", [("qwen3_moe", True), ("gpt_oss", False)])
def test_moe_tp4_matches_hf(ranks4, model_type, sp):
    assert ranks4.run(moe_training_matches_hf, model_type, 4, sp)[0]["sharded"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_checkpoints_at_tp2_round_trip_through_plain_transformers(ranks2, tmp_path, model_type):
    """from_pretrained of transformers' per-expert files (Mixtral's renamed block_sparse_moe.*.w1/w3/w2,
    Qwen3-MoE's gate/up/down_proj) or fused ones (gpt-oss); save_pretrained / consolidate load in
    plain transformers with the same logits; the tp=2 checkpoint loads at tp=1."""
    done = ranks2.run(moe_checkpoints_round_trip, model_type, str(tmp_path))[0]
    assert done == ["from_pretrained", "save_pretrained+consolidate", "tp->1 load"]


def test_nxd_trainer_tp2_accumulation_with_aux_loss_matches_trainer(ranks2, tmp_path):
    """Mixtral with output_router_logits (the aux loss in every micro-batch's loss), tp=2 and
    gradient accumulation 2: NxDTrainer's logged losses, grad norms and final parameters are
    transformers.Trainer's."""
    assert len(ranks2.run(moe_trainer_matches_hf, str(tmp_path))[0]) == 3


def test_identity_experts_count_once_over_tp(ranks2):
    """LongCat's identity experts (HF "moe_identity_expert") inside the TP region add their input on one rank."""
    assert ranks2.run(identity_experts_match, 2)[0] > 0


def test_check_parity_covers_moe():
    """nxd_hf.check_parity (and so ``nxd-hf check``) on a full-size Qwen3-MoE config: shrunk with its
    top-8 routing and 16 experts kept, it passes at tp=2 with SP."""
    import transformers

    import nxd_hf

    result = nxd_hf.check_parity(transformers.Qwen3MoeConfig(), tensor_parallel_size=2, sequence_parallel=True)
    assert result.status == "pass", result.message
