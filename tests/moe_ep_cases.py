"""Tiny Mixtral- and Qwen3-MoE-shaped models and the expert-parallel parity cases run on the rank
pools by tests/distributed/test_moe_ep.py."""

import torch
import transformers

from nxd_hf import backend, parity

VOCAB = 101

# model_type -> (config class, causal-LM class, config kwargs): 4 or 8 experts, top-2, no jitter.
MOE_TINY = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, tie_word_embeddings=False,
        router_jitter_noise=0.0, output_router_logits=True, router_aux_loss_coef=0.02)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=VOCAB, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.01)),
}


def config(model_type: str, **overrides):
    config_cls, _, kwargs = MOE_TINY[model_type]
    return config_cls(**{**kwargs, **overrides})


def build_pair(model_type: str, seed: int = 0, **overrides):
    """(reference, copy to parallelize) with identical fp32 weights (random norm weights)."""
    return parity.build_pair(config(model_type, **overrides), MOE_TINY[model_type][1], seed=seed, perturb="all")


def batch(seed: int = 1, b: int = 2, s: int = 8):
    ids, labels = parity.make_batch(VOCAB, batch_size=b, seq_len=s, seed=seed)
    device = backend.default_device()
    return ids.to(device), labels.to(device)
