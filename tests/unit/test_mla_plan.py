"""Plans derived for multi-head latent attention (``nxd_hf.tp.mla``), HRM's two layer stacks and
per-head attention gates, and the head-block rows of ``HeadLayout`` (no processes)."""

import pytest
import torch
import transformers

from nxd_hf.parallel_layers.heads import head_layout
from nxd_hf.tp import derive, mla
from nxd_hf.tp.plan import Column, PerHeadNorm, Row


def _patch(config):
    return derive.patch_from_hf_plan(config.model_type, config.base_model_tp_plan, config=config)


def test_minicpm3_plan_shards_up_projections_by_head_blocks():
    patch = _patch(transformers.MiniCPM3Config())
    plan = patch.plan
    assert isinstance(plan["layers.*.self_attn"], mla.LatentAttention)
    for leaf in ("q_proj", "q_b_proj", "kv_b_proj"):
        assert plan[f"layers.*.self_attn.{leaf}"] == Column(heads="head_blocks")
    assert plan["layers.*.self_attn.o_proj"] == Row(heads="head_blocks")
    for leaf in mla.DOWN_PROJECTIONS:
        assert plan[f"layers.*.self_attn.{leaf}"] == PerHeadNorm()
    assert patch.sequence_parallel and patch.num_kv_heads_attr is None


def test_deepseek_v3_gets_the_mla_entries_its_plan_leaves_out_but_kimi_linear_does_not():
    plan = _patch(transformers.DeepseekV3Config()).plan
    assert isinstance(plan["layers.*.self_attn"], mla.LatentAttention)
    assert plan["layers.*.self_attn.kv_b_proj"] == Column(heads="head_blocks")
    kimi = _patch(transformers.KimiLinearConfig())  # mixes linear and MLA attention layers: left replicated
    assert not any(isinstance(s, mla.LatentAttention) for s in kimi.plan.values())


def test_unsupported_style_and_several_rowwise_layers_in_mla_are_refused():
    base = {"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "layers.*.self_attn.kv_b_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise"}
    with pytest.raises(ValueError, match="'gather' inside the multi-head latent attention"):
        derive.patch_from_hf_plan("x", {**base, "layers.*.self_attn.g_proj": "gather"})
    with pytest.raises(ValueError, match="several rowwise layers"):
        derive.patch_from_hf_plan("x", {**base, "layers.*.self_attn.dt_proj": "rowwise"})


def test_hrm_two_layer_stacks_shard_without_sequence_parallelism():
    patch = _patch(transformers.HrmTextConfig())
    assert patch.decoder_layers == "H_module.layers" and not patch.sequence_parallel
    for stack in ("H_module", "L_module"):  # its output gate: one block per query head
        assert patch.plan[f"{stack}.layers.*.self_attn.gate_proj"] == Column(heads="head_blocks")


def test_head_blocks_pad_heads_that_tp_does_not_divide():
    # 6 heads over tp=4 -> 8 (2 per rank): rank 2 holds head 4, 5; rank 3 two padding heads
    layouts = [head_layout(6, 6, 4, rank, 4) for rank in range(4)]
    assert torch.equal(layouts[2].head_blocks(6 * 3), torch.arange(12, 18))
    assert torch.equal(layouts[3].head_blocks(6 * 5), torch.full((10,), -1))
    assert torch.equal(layouts[0].head_blocks(6), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        layouts[0].head_blocks(7)


def test_per_layer_head_counts_other_than_the_configs_are_refused_at_every_tp():
    """Laguna's num_attention_heads_per_layer: the head layout reads config.num_attention_heads for every
    layer, so the model crashed in its gate even at tp=1 before; now a ValueError names the field."""
    config = transformers.AutoConfig.for_model("laguna", num_attention_heads=12, num_attention_heads_per_layer=[48, 48],
                                               num_hidden_layers=2)
    with pytest.raises(ValueError, match="num_attention_heads_per_layer"):
        derive.patch_from_hf_plan("laguna", config.base_model_tp_plan, config=config)
    config.num_attention_heads_per_layer = [12, 12]
    derive.patch_from_hf_plan("laguna", config.base_model_tp_plan, config=config)
