"""Every byte nxd_hf reads from or writes to disk."""

from nxd_hf.checkpoint.hf_safetensors import LoadReport, load_hf_safetensors

__all__ = ["LoadReport", "load_hf_safetensors"]
