"""Every byte nxd_hf reads from or writes to disk."""

from nxd_hf.checkpoint.consolidate import consolidate, save_pretrained
from nxd_hf.checkpoint.full import full_optimizer_state, full_state_dict
from nxd_hf.checkpoint.hf_safetensors import LoadReport, load_hf_safetensors
from nxd_hf.checkpoint.load import load_checkpoint
from nxd_hf.checkpoint.logical import LogicalTensor, logical_tensors
from nxd_hf.checkpoint.save import save_checkpoint
from nxd_hf.checkpoint.writer import wait_for_checkpoint

__all__ = [
    "LoadReport", "LogicalTensor", "consolidate", "full_optimizer_state", "full_state_dict", "load_checkpoint",
    "load_hf_safetensors", "logical_tensors", "save_checkpoint", "save_pretrained", "wait_for_checkpoint",
]
