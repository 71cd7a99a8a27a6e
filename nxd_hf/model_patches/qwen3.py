"""Qwen3: Llama's layout plus ``q_norm``/``k_norm``, RMSNorms over ``head_dim`` applied to each
head after the q/k projections (before RoPE). Each rank normalizes only its local heads with
the full (replicated) weight, so the weight's gradient is partial over TP and summed by the
post-backward hook. ``head_dim`` is a config field, not necessarily hidden_size / heads."""

from nxd_hf.model_patches.llama import DECODER_PLAN
from nxd_hf.tp.plan import ModelPatch, PerHeadNorm
from nxd_hf.tp.registry import register_patch

PATCH = register_patch(ModelPatch(model_type="qwen3", plan=DECODER_PLAN | {
    "layers.*.self_attn.q_norm": PerHeadNorm(),
    "layers.*.self_attn.k_norm": PerHeadNorm(),
}))
