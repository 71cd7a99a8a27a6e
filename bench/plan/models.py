"""The bench's models (small, random weights) and its grid of layouts. Each is ~10-20M parameters:
below that a rank's peak is a few MiB, where what the cost model leaves out (Python objects of the
modules and optimizer, allocator slack: 1-7 MiB measured) is more than 10% of it."""

import transformers

MODELS = {
    # ~14M parameters, GQA 8/2 (K/V replicated at tp=4), vocab 1001 (padded at tp > 1)
    "llama-s": lambda: transformers.LlamaConfig(
        vocab_size=1001, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    # ~19M parameters, Qwen2: Q/K/V biases, tied embeddings, 8/8 heads (MHA)
    "qwen2-s": lambda: transformers.Qwen2Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True),
    # Mixtral: 4 experts, top-2 (MoE at tp=1)
    "mixtral-t": lambda: transformers.MixtralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512),
    # ~15M parameters, GPT-2: Conv1D projections, learned positions, tied head, dropout, gelu_new
    "gpt2-s": lambda: transformers.GPT2Config(
        vocab_size=4096, n_embd=512, n_layer=4, n_head=8, n_positions=512, tie_word_embeddings=True),
    # ~18M parameters, Phi-3: fused qkv_proj and gate_up_proj, untied
    "phi3-s": lambda: transformers.Phi3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0),
    # Qwen3: per-head q/k norms, GQA 8/4
    "qwen3-s": lambda: transformers.Qwen3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False),
    # GPT-NeoX: per-head fused qkv, parallel residual, partial rotary, plain GELU MLP
    "neox-s": lambda: transformers.GPTNeoXConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
        max_position_embeddings=512, tie_word_embeddings=False),
    # Gemma: tied and scaled embeddings, GeGLU, GQA 8/2
    "gemma-s": lambda: transformers.GemmaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512),
}

# (model, tp, pp, dp, options); batch per DP replica and sequence length in run.py
GRID = [
    ("llama-s", 1, 1, 1, {}),
    ("llama-s", 1, 1, 1, {"recompute": True}),
    ("llama-s", 1, 1, 1, {"lora": True}),
    ("qwen2-s", 1, 1, 1, {}),
    ("mixtral-t", 1, 1, 1, {}),
    ("llama-s", 2, 1, 1, {}),
    ("llama-s", 2, 1, 1, {"sequence_parallel": True}),
    ("llama-s", 1, 1, 2, {}),
    ("llama-s", 1, 1, 2, {"zero_1": True}),
    ("llama-s", 1, 2, 1, {"schedule": "1f1b", "num_microbatches": 2}),
    ("qwen2-s", 2, 1, 1, {"lora": True}),
    ("llama-s", 4, 1, 1, {}),
    ("llama-s", 2, 1, 2, {"zero_1": True}),
    ("llama-s", 2, 2, 1, {"schedule": "gpipe", "num_microbatches": 4}),
]

# layouts outside the grid where the plan's activations were once hand-counted from the config
# and missed (GPT-2's dropout masks and attention, gpipe's held microbatches): run with --grid extra
EXTRA = [
    ("gpt2-s", 2, 1, 1, {}),
    ("phi3-s", 2, 2, 1, {"schedule": "gpipe", "num_microbatches": 2}),
    ("phi3-s", 2, 1, 1, {"sequence_parallel": True, "recompute": True}),
    ("qwen2-s", 1, 1, 2, {"zero_1": True, "lora": True}),
]

# the architectures of the sweep validated with a few layouts each (``--grid sweep``; cases() drops
# sequence parallelism where the architecture's patch refuses it and LoRA where it has no q_proj)
# FSDP2's ZeRO-3 / ZeRO-2 (``data_parallel_sharding``): run with --grid fsdp
FSDP = [
    ("llama-s", 1, 1, 2, {"data_parallel_sharding": "zero3"}),
    ("llama-s", 1, 1, 2, {"data_parallel_sharding": "zero2"}),
    ("qwen2-s", 1, 1, 2, {"data_parallel_sharding": "zero3"}),
    ("llama-s", 2, 1, 2, {"data_parallel_sharding": "zero3", "sequence_parallel": True}),
]

SWEEP_MODELS = ["gpt2-s", "phi3-s", "qwen3-s", "neox-s", "gemma-s"]
SWEEP_LAYOUTS = [
    (2, 1, 1, {}),
    (1, 2, 1, {"schedule": "1f1b", "num_microbatches": 2}),
    (1, 1, 2, {"zero_1": True}),
    (2, 1, 1, {"sequence_parallel": True, "recompute": True}),
    (2, 1, 1, {"lora": True}),
]
SWEEP = [(m, tp, pp, dp, options) for m in SWEEP_MODELS for tp, pp, dp, options in SWEEP_LAYOUTS]
