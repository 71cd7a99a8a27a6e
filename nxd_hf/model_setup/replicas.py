"""Data-parallel replicas must start from the same weights.

Each rank builds its own copy of the model; a script that builds it from an unseeded random
init gets replicas that train on different weights without any error (DP then averages
gradients of different models). NxD and nnScaler leave that to the user (``broadcast_weights``);
here setup checks it: one all-reduce of two float64 fingerprints per parameter over the DP
group, and every rank raises the same ValueError naming the parameters that differ.
Expert-parallel parameters are compared over the expert-data group (the ranks holding the same experts).
"""

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import is_expert_parallel


def _fingerprints(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[2 * n] on ``device``: each parameter's sum and sum of squares, in float64."""
    values = []
    for p in params:
        flat = p.detach().double().reshape(-1)
        values += [flat.sum().to(device), flat.square().sum().to(device)]
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device)


def check_replicas_equal(modules: list[nn.Module]) -> None:
    """ValueError on every rank when this rank's parameters differ from its DP replicas'."""
    if parallel_state.get_data_parallel_size() == 1:
        return
    named = {}
    for root in modules:
        for name, param in root.named_parameters():
            if not param.is_meta:
                named.setdefault(id(param), (name, param))
    listed = []
    for experts, group in ((False, parallel_state.get_data_parallel_group()),
                           (True, parallel_state.get_expert_data_parallel_group())):
        chosen = [(n, p) for n, p in named.values() if is_expert_parallel(p) == experts]
        if chosen or not experts:  # expert tensors exist on every rank or on none (ep > 1)
            listed += _differing([n for n, _ in chosen], [p for _, p in chosen], group)
    if listed:
        raise ValueError(
            f"data-parallel replicas hold different weights ({len(listed)} parameters differ, e.g. {listed[:3]}): "
            "every rank must build the model identically: call transformers.set_seed(seed) (or torch.manual_seed) "
            "with the same seed on every rank before building it, or load the weights (nxd_hf.from_pretrained), "
            "or copy rank 0's weights to the others (torch.distributed.broadcast of each parameter) before setup")


def _differing(names: list[str], params: list[torch.Tensor], group) -> list[str]:
    """The names of ``params`` that differ from their replicas over ``group``."""
    mine = _fingerprints(params, backend.collective_device(group))
    extremes = torch.cat([mine, -mine])
    backend.all_reduce(extremes, group, op="max")
    highest, lowest = extremes[: len(mine)].cpu(), -extremes[len(mine):].cpu()
    differ = (highest != lowest).view(-1, 2).any(dim=1)
    return [names[i] for i in differ.nonzero().view(-1).tolist()]
