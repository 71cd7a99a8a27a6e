"""Tensor x expert parallelism: experts split over EP (all-to-all dispatch outermost) and
their intermediate dims over TP inside, at world 4 = tp 2 x dp 2 carved into one ep=2 block, exact
against the unparallelized HF model."""

import pytest
import torch
from support.moe import build_pair
from support.moe_ep import check_trainer_matches

import nxd_hf
from nxd_hf import parallel_state
from support.moe_tp_ep import sharded_over_tp_and_ep, tp_ep_training_matches_hf
from support.moe_tp_ep_ckpt import checkpoint_reshards, pretrained_round_trip_at_tp2_ep2


def lora_at_tp_ep_matches_peft(model_type: str, tp: int, ep: int) -> None:
    """LoRA through plain peft at tp x ep: with the experts in ``target_parameters`` a ValueError on
    every rank (peft sizes that adapter from the local slice); on attention and the dense/shared
    MLPs (the frozen experts still dispatch every token) five AdamW steps equal plain peft."""
    import copy

    import peft
    import pytest

    from support import lora
    from support.moe_pp import build_pair as lora_pair, moe_lora_config

    parallel_state.destroy_model_parallel()
    model = nxd_hf.parallelize(lora_pair(model_type, aux=False)[1], tensor_parallel_size=tp, expert_parallel_size=ep)
    with pytest.raises(ValueError, match="target_parameters"):
        peft.get_peft_model(model, moe_lora_config(model_type))
    parallel_state.destroy_model_parallel()
    reference, model = lora_pair(model_type, aux=False)
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert sharded_over_tp_and_ep(model)
    config = moe_lora_config(model_type, experts=False)
    torch.manual_seed(7)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(7)
    par_peft = peft.get_peft_model(model, copy.deepcopy(config))
    lora.train_and_compare(ref_peft, par_peft, f"{model_type} lora tp={tp} ep={ep}",
                                 dp=parallel_state.get_data_parallel_size())


def tp_ep_refusals() -> None:
    """What tp x ep cannot split is a ValueError naming the fix, on every rank (world 4)."""
    import pytest

    cases = [
        (dict(num_local_experts=6), dict(expert_parallel_size=4), "must divide the data-parallel size"),
        (dict(num_local_experts=3), dict(expert_parallel_size=2), "3 experts, not divisible by expert_parallel_size=2"),
        (dict(intermediate_size=33), dict(expert_parallel_size=2), r"intermediate size \(33\) must be divisible by the "
                                                                   r"tensor parallel size \(2\)"),
    ]
    for overrides, sizes, message in cases:
        parallel_state.destroy_model_parallel()
        _, model = build_pair("mixtral", output_router_logits=False, **overrides)
        with pytest.raises(ValueError, match=message):
            nxd_hf.parallelize(model, tensor_parallel_size=2, **sizes)
    parallel_state.destroy_model_parallel()


MODEL_TYPES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("sp,aux", [(False, False), (True, True)], ids=["plain", "sp_aux_loss"])
def test_tp2_ep2_matches_hf(ranks4, model_type, sp, aux):
    """Loss, the global aux loss (output_router_logits), every gathered gradient over 3 AdamW steps,
    eval logits, each replica on its own rows; with SP and the aux loss, and without either."""
    result = ranks4.run(tp_ep_training_matches_hf, model_type, 2, 2, sp, aux)[0]
    assert result["both_sharded"], "the experts must be sharded over both TP and EP"
    if aux and model_type != "deepseek_v3":  # DeepSeek-V3 has no aux loss (bias-corrected routing)
        assert len(result["aux_losses"]) == 3


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoint_at_tp2_ep2_reshards(ranks4, tmp_path, model_type):
    """save_checkpoint at tp2 x ep2 (experts stored as boxes: 2 expert blocks x the TP rows),
    load_checkpoint at tp1 x dp4, tp1 x ep2, tp2 x dp2 and tp2 x ep2: model and AdamW state equal
    exactly, one more step equals the uninterrupted run."""
    boxes = ranks4.run(checkpoint_reshards, model_type, str(tmp_path / "ckpt"), (2, 2),
                       [(1, 1), (1, 2), (2, 1), (2, 2)])[0]
    assert sorted({experts for experts, _ in boxes}) == [(0, 2), (2, 4)], boxes
    assert all(len(inner) == 3 for _, inner in boxes) and len(boxes) >= 4, boxes


@pytest.mark.parametrize("save_layout", [(1, 2), (2, 1)], ids=["from_tp1_ep2", "from_tp2_dp2"])
def test_checkpoint_loads_at_tp2_ep2(ranks4, tmp_path, save_layout):
    """A checkpoint of experts split along one dim (over EP, or over TP) loads at tp2 x ep2 (boxes read
    from rows): model and AdamW state equal exactly, one more step equals the uninterrupted run."""
    boxes = ranks4.run(checkpoint_reshards, "qwen3_moe", str(tmp_path / "ckpt"), save_layout, [(2, 2)])[0]
    assert all(not inner for _, inner in boxes), boxes


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_from_pretrained_save_pretrained_consolidate_at_tp2_ep2(ranks4, tmp_path, model_type):
    """from_pretrained at tp2 x ep2 reads exactly this rank's bytes (its experts' TP rows of
    transformers' per-expert tensors, gpt-oss's fused ones); save_pretrained and consolidate
    write transformers' names and load in plain transformers with the same logits."""
    for result in ranks4.run(pretrained_round_trip_at_tp2_ep2, model_type, str(tmp_path)):
        assert result["bytes_read"] == result["local_bytes"], result
        assert result["local_bytes"] < result["whole_bytes"] / 2, result


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nxd_trainer_at_tp2_ep2_matches_trainer(ranks4, tmp_path, accumulate):
    """NxDTrainer at tp2 x ep2 (dp 2): the logged losses and grad norms of transformers.Trainer
    (AdamW, weight decay, clipping, warmup, gradient accumulation) and its final parameters."""
    ranks4.run(check_trainer_matches, "mixtral", str(tmp_path), 2, accumulate, False, False, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_lora_at_tp2_ep2(ranks4, model_type):
    """peft on the experts (target_parameters) is a ValueError at tp2 x ep2; LoRA on attention and
    the shared expert / dense MLP (qwen2_moe) equals plain peft over five AdamW steps."""
    ranks4.run(lora_at_tp_ep_matches_peft, model_type, 2, 2)


def test_tp2_ep2_refusals(ranks4):
    """Experts not divisible by ep, an intermediate size not divisible by tp, ep not dividing dp."""
    ranks4.run(tp_ep_refusals)


def test_check_command_at_tp2_ep2(no_rank_pool, tmp_path, capsys):
    """``nxd-hf check --tp 2 --ep 2`` on a Qwen3-MoE config (world 4: the shrunk model keeps 16 experts, top-4)."""
    import transformers

    from nxd_hf.cli import main

    transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
                                num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=4, vocab_size=500).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "2", "--ep", "2"]) == 0
    assert "(tp=2 pp=1 ep=2): pass" in capsys.readouterr().out


@pytest.mark.parametrize("zero_1", [False, True], ids=["adamw", "zero1"])
def test_nxd_trainer_at_tp2_ep2_with_aux_loss_matches_trainer(ranks4, tmp_path, zero_1):
    """The same with the global load-balancing loss in the loss, with and without ZeRO-1."""
    ranks4.run(check_trainer_matches, "mixtral", str(tmp_path), 2, 2, zero_1, True, 2)


def test_zero1_sharded_state_at_tp2_ep2_reshards(ranks4, tmp_path):
    """ZeRO-1 at tp2 x ep2 (experts' state sharded over expert_data): save_sharded_state_dict loads at
    tp1 x dp4 and tp2 x ep2 with ZeRO-1, the state equal exactly, the next step equal."""
    ranks4.run(checkpoint_reshards, "mixtral", str(tmp_path / "zero1"), (2, 2), [(1, 1), (2, 2)], True)
