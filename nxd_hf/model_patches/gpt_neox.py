"""GPT-NeoX (Pythia): fused ``query_key_value`` interleaved per head (``[q_h k_h v_h]``, MHA),
parallel residual, untied head.

Transformers 5 names the head ``lm_head`` (checkpoints store ``embed_out``; HF's conversion
mapping renames it on load). The attention forward reads only ``head_size`` and views with -1,
so no attribute changes per rank.
"""

from nxd_hf.tp.plan import Attention, Column, Embedding, ModelPatch, ParallelRegion, Row
from nxd_hf.tp.registry import register_patch

PLAN = {
    "embed_in": Embedding(),
    "layers.*.attention": Attention(attrs=()),
    "layers.*.attention.query_key_value": Column(heads="qkv_per_head"),
    "layers.*.attention.dense": Row(heads="q"),
    "layers.*.mlp": ParallelRegion(),
    "layers.*.mlp.dense_h_to_4h": Column(),
    "layers.*.mlp.dense_4h_to_h": Row(),
}

PATCH = register_patch(ModelPatch(model_type="gpt_neox", plan=PLAN, num_kv_heads_attr=None))
