"""Phi-3: fused ``qkv_proj`` (stacked ``[q; k; v]``, GQA) and fused ``gate_up_proj``.

Both fused projections are split for real: each rank holds its own query heads followed by
its K/V heads, and its slice of ``gate`` followed by its slice of ``up`` (stride 2), so HF's
``qkv[..., :query_pos]`` slicing and ``chunk(2, dim=-1)`` see a local layout of the same form.
"""

from nxd_hf.tp.plan import Attention, Column, Embedding, ModelPatch, ParallelRegion, Row
from nxd_hf.tp.registry import register_patch

# Phi3Attention.forward slices qkv with config.num_attention_heads and self.num_key_value_heads;
# the config entries live in the module's private config copy.
LOCAL_HEAD_ATTRS = (
    ("num_key_value_groups", "num_kv_groups"),
    ("num_key_value_heads", "num_kv_heads"),
    ("config.num_attention_heads", "num_heads"),
    ("config.num_key_value_heads", "num_kv_heads"),
)

PLAN = {
    "embed_tokens": Embedding(),
    "layers.*.self_attn": Attention(attrs=LOCAL_HEAD_ATTRS),
    "layers.*.self_attn.qkv_proj": Column(heads="qkv"),
    "layers.*.self_attn.o_proj": Row(heads="q"),
    "layers.*.mlp": ParallelRegion(),
    "layers.*.mlp.gate_up_proj": Column(stride=2),  # [gate; up] -> [gate_r; up_r]
    "layers.*.mlp.down_proj": Row(),
}

PATCH = register_patch(ModelPatch(model_type="phi3", plan=PLAN))
