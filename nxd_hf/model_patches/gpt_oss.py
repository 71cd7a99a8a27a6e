"""gpt-oss (transformers has no ``base_model_tp_plan`` for it): Llama's attention with biases and
one learned attention sink per query head (``self_attn.sinks``, sharded with the heads), and a
mixture-of-experts MLP whose fused experts hold biases, an interleaved ``[g0 u0 g1 u1 ...]``
``gate_up_proj`` ``[E, H, 2I]`` and a clamped SwiGLU. The experts are sharded over TP by
``nxd_hf.moe.tp_experts`` (interleaved pairs kept together, ``down_proj_bias`` added once);
the router stays replicated."""

from nxd_hf.model_patches.llama import DECODER_PLAN
from nxd_hf.tp.plan import Column, Experts, ModelPatch
from nxd_hf.tp.registry import register_patch

ATTENTION_PLAN = {pattern: style for pattern, style in DECODER_PLAN.items() if not pattern.startswith("layers.*.mlp")}

PATCH = register_patch(ModelPatch(model_type="gpt_oss", plan=ATTENTION_PLAN | {
    "layers.*.self_attn.sinks": Column(),
    "layers.*.mlp.experts": Experts(),
}))
