"""Tensor-parallel plans for Hugging Face models: data (``plan``), the registry by model type,
and the code applying a plan."""

from nxd_hf.tp.plan import Attention, Column, Embedding, LMHead, ModelPatch, ParallelRegion, PerHeadNorm, Row
from nxd_hf.tp.registry import get_patch, register_patch, registered_model_types

__all__ = [
    "Attention", "Column", "Embedding", "LMHead", "ModelPatch", "ParallelRegion", "PerHeadNorm", "Row", "get_patch",
    "register_patch", "registered_model_types",
]
