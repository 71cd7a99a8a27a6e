"""Mistral: Llama's layout (GQA, no biases); the sliding window does not depend on heads."""

from nxd_hf.model_patches.llama import DECODER_PLAN
from nxd_hf.tp.plan import ModelPatch
from nxd_hf.tp.registry import register_patch

PATCH = register_patch(ModelPatch(model_type="mistral", plan=dict(DECODER_PLAN)))
