"""Experts sharded over TP (HF's "moe_tp_experts", ``nxd_hf.moe.tp_experts``): tiny Mixtral,
Qwen3-MoE, DeepSeek-V3 (shared experts, routed scaling) and gpt-oss (expert biases, sinks,
interleaved clamped SwiGLU) at tp=2 and tp=4, with and without sequence parallelism, against the
unparallelized HF model: loss, the aux loss with output_router_logits, every gathered gradient,
three AdamW steps, eval logits."""

import pytest
import torch
import transformers

import nxd_hf
from nxd_hf import parallel_state, parity
from support.moe import (
    eval_logits_of, backward_and_step, batch, build_pair, eval_logits_match, saved_as_transformers, TOL, VOCAB,
)


def moe_training_matches_hf(model_type: str, tp: int, sp: bool, steps: int = 3) -> dict:
    """``steps`` AdamW steps at ``tp`` (SP on/off) equal HF's: loss, aux loss, every gradient,
    then the eval logits. Returns what was compared, for the test to assert on."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp)
    sharded = [n for n, p in model.named_parameters() if "experts" in n and getattr(p, "tensor_model_parallel", False)]
    # every gradient is compared before each step; after the steps only losses and logits are,
    # which Adam's amplified rounding (~1e-5 in a few elements at lr 1e-2) moves by ~1e-7
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    aux_losses = []
    for step in range(steps):
        ids, mask, labels = batch(seed=step + 1)
        ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        label = f"{model_type} tp={tp} sp={sp} step {step}"
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL, msg=lambda m: f"{label} loss: {m}")
        if getattr(ref_out, "aux_loss", None) is not None:
            torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, **TOL, msg=lambda m: f"{label} aux: {m}")
            aux_losses.append(float(ref_out.aux_loss))
        backward_and_step(model, reference, ref_out.loss, out.loss, ref_opt, opt, label)
    eval_logits_match(model, reference)
    return {"sharded": sharded, "aux_losses": aux_losses}


def moe_checkpoints_round_trip(model_type: str, tmp: str, tp: int = 2) -> list[str]:
    """At ``tp``: ``from_pretrained`` of what transformers' ``save_pretrained`` wrote (per-expert
    names for most MoE types) reads the local slices; ``save_pretrained``, and ``save_checkpoint``
    + ``consolidate``, write what plain transformers loads with the same logits; a tp checkpoint
    loads into a tp=1 model (dp=world) with the same weights. Returns the steps that ran."""
    import os

    rank = torch.distributed.get_rank()
    done = []
    reference, _ = build_pair(model_type)
    ids = batch()[0]
    expected = eval_logits_of(reference, ids)
    hf_dir, ckpt = os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt")
    if rank == 0:
        reference.save_pretrained(hf_dir)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    model = nxd_hf.from_pretrained(hf_dir, tensor_parallel_size=tp, dtype=torch.float32)
    assert any(getattr(p, "tensor_model_parallel", False) for n, p in model.named_parameters() if "experts" in n)
    torch.testing.assert_close(eval_logits_of(model, ids), expected, **TOL)
    done.append("from_pretrained")
    saved_as_transformers(model, tmp, ids, expected)
    done.append("save_pretrained+consolidate")
    parallel_state.destroy_model_parallel()
    _, fresh = build_pair(model_type)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    nxd_hf.parallelize(fresh, tensor_parallel_size=1)
    nxd_hf.load_checkpoint(ckpt, tag="t", model=fresh)
    state = fresh.state_dict()  # tp=1: whole tensors
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    done.append("tp->1 load")
    return done


def moe_trainer_matches_hf(out_dir: str, accumulate: int = 2, steps: int = 3) -> list[float]:
    """NxDTrainer at tp=2 with gradient accumulation on Mixtral with output_router_logits (the
    aux loss in every micro-batch's loss) equals transformers.Trainer on the same model and data:
    logged losses and grad norms, final parameters. Returns the logged losses."""
    from nxd_hf.parallel_layers.sharding import full_tensor

    parallel_state.destroy_model_parallel()
    reference, model = build_pair("mixtral")
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": (ids := torch.randint(0, VOCAB, (8,), generator=g)), "labels": ids.clone()}
            for _ in range(16)]
    common = dict(max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
                  disable_tqdm=True, per_device_train_batch_size=2, gradient_accumulation_steps=accumulate)
    ref = transformers.Trainer(reference, transformers.TrainingArguments(output_dir=f"{out_dir}/ref", **common),
                               train_dataset=data)
    ref.train()
    ours = nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", tensor_parallel_size=2,
                                                                 **common), train_dataset=data)
    ours.train()
    for key in ("loss", "grad_norm"):
        want = [h[key] for h in ref.state.log_history if key in h and "train_runtime" not in h]
        got = [h[key] for h in ours.state.log_history if key in h and "train_runtime" not in h]
        assert len(got) == len(want) == steps, (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    return [h["loss"] for h in ours.state.log_history if "loss" in h]


def identity_experts_match(tp: int) -> int:
    """LongCat-Flash's MoE block (identity experts past the routed ones) with its experts sharded
    over TP by ``shard_experts``: output and every gradient (input, router, gathered expert weights)
    equal the unsharded block's. Before transformers 5.25 the experts module itself runs the
    identity experts, inside the TP region; from 5.25 the block adds them outside it. Returns the
    tokens routed to an identity expert."""
    import copy

    from nxd_hf.moe.tp_experts import shard_experts
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = transformers.LongcatFlashConfig(hidden_size=16, expert_ffn_hidden_size=8, n_routed_experts=4,
                                             zero_expert_num=2, moe_topk=2, hidden_act="silu")
    torch.manual_seed(0)
    reference = LongcatFlashMoE(config)
    with torch.no_grad():
        reference.experts.gate_up_proj.normal_()
        reference.experts.down_proj.normal_()
        reference.router.classifier.weight.normal_()
    sharded = copy.deepcopy(reference)
    shard_experts("experts", sharded.experts)
    assert sharded.experts.down_proj.shape[-1] * tp == reference.experts.down_proj.shape[-1], "sharded over TP"
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    outs = []
    for module in (reference, sharded):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * torch.arange(16.0)).sum().backward()
        outs.append((out.detach(), xi.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, **TOL)
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(parity.gathered_grad(param), dict(reference.named_parameters())[name].grad, **TOL)
    return int((reference.router(x)[2] >= config.n_routed_experts).sum())


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
    """LongCat's identity experts add their input once over TP (inside the TP region before transformers 5.25)."""
    assert ranks2.run(identity_experts_match, 2)[0] > 0


def test_check_parity_covers_moe():
    """nxd_hf.check_parity (and so ``nxd-hf check``) on a full-size Qwen3-MoE config: shrunk with its
    top-8 routing and 16 experts kept, it passes at tp=2 with SP."""
    import transformers

    import nxd_hf

    result = nxd_hf.check_parity(transformers.Qwen3MoeConfig(), tensor_parallel_size=2, sequence_parallel=True)
    assert result.status == "pass", result.message
