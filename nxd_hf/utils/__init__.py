"""Small helpers: NxD's ``neuronx_distributed.utils.model_utils`` names, and module bookkeeping."""

import contextlib

import torch


@contextlib.contextmanager
def init_on_device(device: torch.device):
    """Create every tensor (parameters and buffers) inside the block on ``device``; with
    ``torch.device("meta")`` a model costs no memory until ``NxDPPModel`` (``param_init_fn``)
    or ``nxd_hf.from_pretrained`` materializes this rank's part of it."""
    with torch.device(device):
        yield


def owners_of(modules) -> dict[int, list]:
    """id(parameter) -> every (module, attribute) holding it among ``modules`` (a tied weight has several)."""
    owners = {}
    for root in modules:
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    owners.setdefault(id(param), []).append((module, name))
    return owners
