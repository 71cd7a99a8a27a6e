"""Tiny mixture-of-experts models (Mixtral, Qwen3-MoE with a dense layer, DeepSeek-V3 with shared
experts and routed scaling, gpt-oss with expert biases, sinks and an interleaved clamped SwiGLU)
and the steps every MoE test compares with the unparallelized HF model: loss with the
load-balancing aux loss, gathered gradients, AdamW steps, eval logits, saved transformers files."""

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parity


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
    # 4 routed experts and 2 identity ("zero") experts, top-2 (test_moe_longcat_ep.py); no aux loss in HF
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


def eval_logits_of(model, ids) -> torch.Tensor:
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
        torch.testing.assert_close(eval_logits_of(plain, ids), expected, **TOL)


def route_to_first_experts(model, count: int) -> None:
    """Route every token to experts ``< count`` (the router's indices modulo ``count``): the ranks
    holding the other experts receive no rows."""
    def hook(_module, _inputs, output):
        logits, scores, indices = output
        return logits, scores, indices % count
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)
