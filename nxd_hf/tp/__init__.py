"""Tensor-parallel plans for Hugging Face models: data (``plan``) and the code applying it."""

from nxd_hf.tp.plan import (
    Attention, Column, Embedding, LMHead, ModelPatch, ParallelRegion, PerHeadNorm, Row, get_patch,
    register_patch,
    registered_model_types,
)

__all__ = [
    "Attention", "Column", "Embedding", "LMHead", "ModelPatch", "ParallelRegion", "PerHeadNorm", "Row", "get_patch",
    "register_patch", "registered_model_types",
]
