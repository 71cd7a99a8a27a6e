"""MoE models through the pipeline at tp=1: tracing and running Mixtral-, Qwen3-MoE-,
OLMoE-, Qwen2-MoE- and DeepSeek-V3-shaped tiny models at pp=2; HF's load-balancing loss over
layers on different stages (several microbatches, both schedules, data parallelism, gradient
accumulation, pp=4); LoRA through peft on attention, dense/shared MLPs and the fused experts;
NxDTrainer against transformers.Trainer; checkpoints across pp and save_pretrained. Case bodies
in tests/moe_pp_cases.py and tests/moe_ckpt_cases.py."""

import pytest
import torch

import moe_ckpt_cases
import moe_pp_cases
from nxd_hf.moe import aux_loss


@pytest.mark.parametrize("model_type", list(moe_pp_cases.TINY_MOE))
def test_pp2_matches_hf_with_aux_loss(ranks2, model_type):
    ranks2.run(moe_pp_cases.pipeline_matches_hf, model_type)


def test_pp2_without_aux_loss(ranks2):
    ranks2.run(moe_pp_cases.pipeline_matches_hf, "qwen3_moe", aux=False)


def test_pp2_gpipe_four_microbatches(ranks2):
    ranks2.run(moe_pp_cases.pipeline_matches_hf, "mixtral", num_microbatches=4, schedule="gpipe", b=8)


def test_pp2_aux_loss_under_activation_checkpointing(ranks2):
    ranks2.run(moe_pp_cases.pipeline_matches_hf, "mixtral", activation_checkpoint_config="full")


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zero_bubble"])
def test_pp2_aux_loss_zero_bubble(ranks2, schedule):
    """The split backward's input step detaches stage outputs in place: the aux loss's hook must not
    leave a view there."""
    ranks2.run(moe_pp_cases.pipeline_matches_hf, "mixtral", schedule=schedule, virtual_pipeline_size=2)


def test_pp2_gradient_accumulation(ranks2):
    ranks2.run(moe_pp_cases.accumulation_matches_hf, "olmoe")


def test_pp2_dp2_aux_loss_over_replicas(ranks4):
    ranks4.run(moe_pp_cases.pipeline_matches_hf, "mixtral", num_microbatches=2, b=8)


def test_pp4_aux_loss(ranks4):
    ranks4.run(moe_pp_cases.pipeline_matches_hf, "qwen2_moe", pp=4, num_microbatches=4, b=8)


@pytest.mark.parametrize("model_type", list(moe_pp_cases.LORA_TARGETS))
def test_lora_dp2_matches_peft(ranks2, model_type):
    ranks2.run(moe_pp_cases.lora_dp_matches_peft, model_type)


@pytest.mark.parametrize("model_type", list(moe_pp_cases.LORA_TARGETS))
def test_lora_pp2_matches_peft_and_saves(ranks2, tmp_path, model_type):
    ranks2.run(moe_pp_cases.lora_pipeline_matches_peft, model_type, str(tmp_path))


def test_nxd_trainer_pp2_matches_trainer(ranks2, tmp_path):
    ranks2.run(moe_pp_cases.trainer_matches_hf, "mixtral", str(tmp_path))


def test_nxd_trainer_lora_dp2_matches_trainer(ranks2, tmp_path):
    ranks2.run(moe_pp_cases.trainer_matches_hf, "qwen2_moe", str(tmp_path), pp=1, lora=True)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "llama"])
def test_nxd_trainer_pp2_evaluate_matches_trainer(ranks2, tmp_path, model_type):
    """Eval batches padded to the microbatches: the padded rows change neither the token loss nor the aux loss."""
    ranks2.run(moe_pp_cases.trainer_eval_matches_hf, model_type, str(tmp_path))


@pytest.mark.parametrize("save_pp, load_pp", [(2, 1), (1, 2)])
def test_checkpoint_across_pp(ranks2, tmp_path, save_pp, load_pp):
    ranks2.run(moe_ckpt_cases.checkpoint_reshards, "qwen3_moe", str(tmp_path), save_pp=save_pp, load_pp=load_pp)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_save_pretrained_pp2_writes_what_transformers_writes(ranks2, tmp_path, model_type):
    ranks2.run(moe_ckpt_cases.save_pretrained_loads_in_transformers, model_type, str(tmp_path))


def _hf_loss_func():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func


@pytest.mark.parametrize("masked", [False, True])
def test_partial_sums_give_hf_aux_loss_and_gradient(masked):
    """Layers and tokens split into parts: summed partial statistics give HF's aux loss, and
    the surrogate's gradient is HF's for every layer's logits."""
    num_experts, top_k, coef = 4, 2, 0.3
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(2, 6, generator=g) > 0.3).long() if masked else None
    logits = [torch.randn(12, num_experts, generator=g, requires_grad=True) for _ in range(3)]
    want = coef * _hf_loss_func()(tuple(logits), num_experts, top_k, mask)
    want.backward()
    want_grads = [l.grad.clone() for l in logits]
    for l in logits:
        l.grad = None
    # three holders: layer 0, then layers 1-2 split into the two rows of the batch
    parts = [(logits[0], mask)]
    for layer in logits[1:]:
        for row in range(2):
            parts.append((layer[row * 6:(row + 1) * 6], None if mask is None else mask[row]))
    stats = sum(aux_loss.router_statistics(l, num_experts=num_experts, top_k=top_k, mask=m) for l, m in parts)
    torch.testing.assert_close(coef * aux_loss.aux_loss(stats, num_experts), want.detach())
    weights = aux_loss.gradient_weights(stats, num_experts, coef)
    surrogate = sum(aux_loss.surrogate_loss(l, weights, m) for l, m in parts)
    torch.testing.assert_close(surrogate, want.detach())
    surrogate.backward()
    for got, expected in zip((l.grad for l in logits), want_grads):
        torch.testing.assert_close(got, expected)


def test_aux_loss_spec_reads_the_model():
    reference, _ = moe_pp_cases.build_pair("mixtral")
    spec = aux_loss.aux_loss_spec(reference)
    assert (spec.num_experts, spec.top_k, spec.coef, spec.index) == (4, 2, moe_pp_cases.AUX_COEF, 0)
    assert spec.router_cls.__name__ == "MixtralTopKRouter"
    assert aux_loss.aux_loss_spec(moe_pp_cases.build_pair("mixtral", aux=False)[0]) is None
    assert aux_loss.aux_loss_spec(moe_pp_cases.build_pair("deepseek_v3")[0]) is None  # HF adds none


def test_random_router_refused_at_pp2(ranks2):
    ranks2.run(moe_pp_cases.random_router_refused_at_pp2, model_parallel=(1, 2))
