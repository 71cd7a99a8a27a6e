"""GPT-2: HF ``Conv1D`` layers (weight ``[in, out]``, transposed on sharding), fused
``c_attn`` (stacked ``[q; k; v]``, MHA), learned positions ``wpe`` replicated, LM head tied
to ``wte``.

Dropout: residual and embedding dropout act on replicated activations and draw the same mask
on every TP rank (seed with ``model_parallel_manual_seed``); attention-probability dropout
acts on the local heads with that same generator, so ranks draw correlated masks for
different heads (correct, not independent as Megatron's tracker would make them).
"""

from nxd_hf.tp.plan import Attention, Column, Embedding, ModelPatch, ParallelRegion, Row
from nxd_hf.tp.registry import register_patch

PLAN = {
    "wte": Embedding(),
    # GPT2Attention.forward splits c_attn's output by split_size; the view uses head_dim and -1.
    "h.*.attn": Attention(attrs=(("split_size", "q_size"), ("num_heads", "num_heads"))),
    "h.*.attn.c_attn": Column(heads="qkv"),
    "h.*.attn.c_proj": Row(heads="q"),
    "h.*.mlp": ParallelRegion(),
    "h.*.mlp.c_fc": Column(),
    "h.*.mlp.c_proj": Row(),
}

PATCH = register_patch(ModelPatch(
    model_type="gpt2", plan=PLAN, base_model_prefix="transformer", decoder_layers="h", num_kv_heads_attr=None,
))
