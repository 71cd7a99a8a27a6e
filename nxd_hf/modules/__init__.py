"""Composite parallel modules (NxD's ``neuronx_distributed.modules``)."""

from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear

__all__ = ["GQAQKVColumnParallelLinear"]
