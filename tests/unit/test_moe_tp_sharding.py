"""How ``nxd_hf.moe.tp_experts`` splits each fused experts layout over TP: concatenated
``[gate; up]`` rows with stride 2, gpt-oss's interleaved pairs with a plain split, the transposed
layouts on the other dim, a down bias kept whole; what it cannot split exactly is refused."""

import pytest
import transformers

from support.moe import tiny_config
from nxd_hf.moe.tp_experts import expert_sharding


def _experts(model_type: str):
    config = tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))


def test_concatenated_gate_up_is_strided_and_down_split_on_its_input():
    assert expert_sharding("e", _experts("mixtral")) == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}


def test_interleaved_transposed_gate_up_keeps_pairs_and_down_bias_stays_whole():
    assert expert_sharding("e", _experts("gpt_oss")) == {
        "gate_up_proj": (2, 1), "gate_up_proj_bias": (1, 1), "down_proj": (1, 1)}


def test_llama4_bmm_experts_are_transposed_and_concatenated():
    config = transformers.Llama4TextConfig(hidden_size=48, intermediate_size=32, intermediate_size_mlp=64,
                                           num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                           num_local_experts=4, num_hidden_layers=1, vocab_size=101)
    experts = transformers.models.llama4.modeling_llama4.Llama4TextExperts(config)
    assert expert_sharding("e", experts) == {"gate_up_proj": (2, 2), "down_proj": (1, 1)}


def test_post_expert_norm_and_unknown_parameters_are_refused():
    experts = _experts("mixtral")
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has_post_expert_norm"):
        expert_sharding("e", experts)
    experts = _experts("mixtral")
    experts.scale = transformers.pytorch_utils.nn.Parameter(experts.down_proj.new_ones(4))
    with pytest.raises(ValueError, match="e.scale"):
        expert_sharding("e", experts)


def test_shrink_keeps_top_k_and_enough_experts_for_ep4():
    from nxd_hf.parity.shrink import shrink_config

    small = shrink_config(transformers.Qwen3MoeConfig())  # 128 experts, top-8
    assert small.num_experts_per_tok == 8 and small.num_experts == 16
    small = shrink_config(transformers.MixtralConfig())  # 8 experts, top-2
    assert small.num_experts_per_tok == 2 and small.num_local_experts == 4
