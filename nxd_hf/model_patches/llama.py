"""Llama: separate q/k/v/o projections (GQA), gate/up/down MLP, untied head."""

from nxd_hf.tp.plan import Attention, Column, Embedding, ModelPatch, ParallelRegion, Row
from nxd_hf.tp.registry import register_patch

DECODER_PLAN = {
    "embed_tokens": Embedding(),
    "layers.*.self_attn": Attention(),
    "layers.*.self_attn.q_proj": Column(heads="q"),
    "layers.*.self_attn.k_proj": Column(heads="kv"),
    "layers.*.self_attn.v_proj": Column(heads="kv"),
    "layers.*.self_attn.o_proj": Row(heads="q"),
    "layers.*.mlp": ParallelRegion(),
    "layers.*.mlp.gate_proj": Column(),
    "layers.*.mlp.up_proj": Column(),
    "layers.*.mlp.down_proj": Row(),
}

PATCH = register_patch(ModelPatch(model_type="llama", plan=DECODER_PLAN))
