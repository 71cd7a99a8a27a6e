"""Tiny mixture-of-experts models (Mixtral, Qwen3-MoE with a dense layer, DeepSeek-V3 with shared
experts and routed scaling, gpt-oss with expert biases, sinks and an interleaved clamped SwiGLU)
and the parity cases of experts sharded over TP: loss, the load-balancing aux loss
(``output_router_logits``, with padding in the attention mask), every gathered gradient, several
AdamW steps, then eval logits, against the unparallelized HF model."""

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state, parity

TOL = dict(rtol=parity.RTOL, atol=parity.ATOL)
VOCAB = 101
_ATTENTION = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=2,
                  tie_word_embeddings=False)

# model_type -> (config class, causal-LM class, config kwargs); intermediate sizes divisible by 2 x 4.
MOE_TINY = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        _ATTENTION, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.3)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(  # layer 1 dense
        _ATTENTION, head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.3)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(  # layer 0 dense
        _ATTENTION, num_key_value_heads=6, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, head_dim=8)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        _ATTENTION, head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, output_router_logits=True,
        router_aux_loss_coef=0.3)),
    # 4 routed experts and 2 identity ("zero") experts, top-2 (tests/moe_longcat_ep_cases.py); no aux loss in HF
    "longcat_flash": (transformers.LongcatFlashConfig, transformers.LongcatFlashForCausalLM, dict(
        hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
        ffn_hidden_size=32, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=8,
        routed_scaling_factor=2.0, tie_word_embeddings=False)),
}


def tiny_config(model_type: str, **overrides):
    config_cls, _, kwargs = MOE_TINY[model_type]
    return config_cls(**{**kwargs, **overrides})


def build_pair(model_type: str, **overrides):
    """(reference, copy to parallelize) with identical fp32 weights, noise on every parameter
    (routers and biases included)."""
    _, model_cls, _ = MOE_TINY[model_type]
    return parity.build_pair(tiny_config(model_type, **overrides), model_cls)


def batch(seed: int = 1):
    """(input_ids, attention_mask, labels): row 1 ends in two padding tokens (masked out of the aux loss)."""
    ids, labels = parity.make_batch(VOCAB, batch_size=2, seq_len=8, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    device = backend.default_device()
    return ids.to(device), mask.to(device), labels.to(device)


def _check_grads(model, reference, label: str) -> None:
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(parity.gathered_grad(param, grad), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{label} {name}: {m}")


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


def backward_and_step(model, reference, ref_loss, loss, ref_opt, opt, label: str) -> None:
    """Both backwards, every gathered gradient equal, both optimizer steps."""
    ref_loss.backward()
    loss.backward()
    _check_grads(model, reference, label)
    for optimizer in (ref_opt, opt):
        optimizer.step()
        optimizer.zero_grad()


def eval_logits_match(model, reference) -> None:
    reference.eval()
    model.eval()
    ids, mask, _ = batch(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits, **TOL)


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _stored_names(directory: str) -> set[str]:
    import json
    import os

    import safetensors

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    with safetensors.safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return set(f.keys())


def saved_as_transformers(model, tmp: str, ids, expected) -> None:
    """``save_pretrained`` (to ``tmp``/ours) and ``save_checkpoint`` (``tmp``/ckpt) + ``consolidate``
    (``tmp``/merged) write the names transformers wrote in ``tmp``/hf, and plain transformers loads
    both with the ``expected`` logits on ``ids``."""
    import os

    hf_dir, ours, ckpt, merged = (os.path.join(tmp, d) for d in ("hf", "ours", "ckpt", "merged"))
    nxd_hf.save_pretrained(model, ours)
    nxd_hf.save_checkpoint(ckpt, tag="t", model=model)
    if torch.distributed.get_rank() == 0:
        nxd_hf.consolidate(ckpt, merged)
    torch.distributed.barrier()
    for directory in (ours, merged):
        assert _stored_names(directory) == _stored_names(hf_dir), directory  # what transformers writes
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        torch.testing.assert_close(_logits(plain, ids), expected, **TOL)


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
    expected = _logits(reference, ids)
    hf_dir, ckpt = os.path.join(tmp, "hf"), os.path.join(tmp, "ckpt")
    if rank == 0:
        reference.save_pretrained(hf_dir)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    model = nxd_hf.from_pretrained(hf_dir, tensor_parallel_size=tp, dtype=torch.float32)
    assert any(getattr(p, "tensor_model_parallel", False) for n, p in model.named_parameters() if "experts" in n)
    torch.testing.assert_close(_logits(model, ids), expected, **TOL)
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
    """LongCat-Flash's experts module (identity experts past the routed ones; HF style
    "moe_identity_expert") sharded over TP by ``shard_experts``: output and every gradient (input,
    top-k weights, gathered expert weights) equal the unsharded module's. Returns the tokens routed
    to an identity expert."""
    import copy

    from nxd_hf.moe.tp_experts import shard_experts
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = transformers.LongcatFlashConfig(hidden_size=16, expert_ffn_hidden_size=8, n_routed_experts=4,
                                             zero_expert_num=2, hidden_act="silu")
    torch.manual_seed(0)
    reference = LongcatFlashExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.normal_()
        reference.down_proj.normal_()
    sharded = copy.deepcopy(reference)
    shard_experts("experts", sharded)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 16, generator=g)
    index = torch.randint(0, 6, (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g)
    outs = []
    for module in (reference, sharded):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xi, index, wi)
        (out * torch.arange(16.0)).sum().backward()
        outs.append((out.detach(), xi.grad, wi.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, **TOL)
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(parity.gathered_grad(param), dict(reference.named_parameters())[name].grad, **TOL)
    return int((index >= 4).sum())
