"""Multi-head latent attention case bodies run on gloo ranks by tests/distributed/test_mla.py:
tiny MiniCPM3- and dense DeepSeek-V2/V3-shaped models (6 heads: padded to 8 at tp=4; head blocks
of different widths for q, k/v and o) against the unparallelized HF model."""

import transformers

import hf_parity

VOCAB = hf_parity.VOCAB
_MLA = dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=6, num_hidden_layers=2,
            vocab_size=VOCAB, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            tie_word_embeddings=False)
_DENSE = dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# model_type -> (config class, task model class, config kwargs), in hf_parity.TINY's shape.
TINY = {
    "minicpm3": (transformers.MiniCPM3Config, transformers.MiniCPM3ForCausalLM, dict(
        _MLA, q_lora_rank=16, attention_bias=True)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _MLA, **_DENSE, q_lora_rank=16, n_shared_experts=1, n_group=1, topk_group=1)),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(  # q_proj (no q LoRA)
        _MLA, **_DENSE, q_lora_rank=None, n_shared_experts=1)),
}
hf_parity.TINY.update(TINY)  # hf_parity.build_pair / lora_cases then build these too
