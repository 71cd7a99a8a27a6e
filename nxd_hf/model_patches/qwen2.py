"""Qwen2: Llama's layout with q/k/v biases (sharded with their rows) and, in the small
sizes, the LM head tied to the embedding (one vocab-sharded parameter)."""

from nxd_hf.model_patches.llama import DECODER_PLAN
from nxd_hf.tp.plan import ModelPatch
from nxd_hf.tp.registry import register_patch

# Qwen2Attention reads only head_dim and num_key_value_groups (Attention's default attrs);
# sliding_window is a sequence length, independent of the head count.
PATCH = register_patch(ModelPatch(model_type="qwen2", plan=dict(DECODER_PLAN)))
