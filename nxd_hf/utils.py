"""Small helpers with NxD's names (``neuronx_distributed.utils.model_utils``)."""

import contextlib

import torch


@contextlib.contextmanager
def init_on_device(device: torch.device):
    """Create every tensor (parameters and buffers) inside the block on ``device``; with
    ``torch.device("meta")`` a model costs no memory until ``NxDPPModel`` (``param_init_fn``)
    or ``nxd_hf.from_pretrained`` materializes this rank's part of it."""
    with torch.device(device):
        yield
