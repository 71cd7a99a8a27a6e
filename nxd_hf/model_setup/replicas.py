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


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """[2] on ``tensor``'s device: its sum and sum of squares, in float64."""
    flat = tensor.detach().double().reshape(-1)
    return torch.stack([flat.sum(), flat.square().sum()])


def check_replicas_equal(modules: list[nn.Module]) -> None:
    """ValueError on every rank when this rank's parameters differ from its DP replicas'."""
    if parallel_state.get_data_parallel_size() == 1:
        return
    named = {}
    for root in modules:
        for name, param in root.named_parameters():
            if not param.is_meta:
                named.setdefault(id(param), (name, param))
    check_fingerprints_equal([(n, fingerprint(p), is_expert_parallel(p))
                              for n, p in named.values()])


def check_fingerprints_equal(fingerprints: list[tuple[str, torch.Tensor, bool]]) -> None:
    """``check_replicas_equal`` on fingerprints taken before (name, ``[sum, sum of squares]`` in
    float64, expert-parallel): ``nxd_hf.fsdp.init`` takes them from each TP-local parameter it
    initializes, before keeping its DP rows. Every rank calls it with the same names."""
    if parallel_state.get_data_parallel_size() == 1:
        return
    listed = []
    for experts, group in ((False, parallel_state.get_data_parallel_group()),
                           (True, parallel_state.get_expert_data_parallel_group())):
        chosen = [(n, f) for n, f, expert in fingerprints if expert == experts]
        if chosen or not experts:  # expert tensors exist on every rank or on none (ep > 1)
            listed += _differing([n for n, _ in chosen], [f for _, f in chosen], group)
    if listed:
        raise ValueError(
            f"data-parallel replicas hold different weights ({len(listed)} parameters differ, e.g. {listed[:3]}): "
            "every rank must build the model identically: call transformers.set_seed(seed) (or torch.manual_seed) "
            "with the same seed on every rank before building it, or load the weights (nxd_hf.from_pretrained), "
            "or copy rank 0's weights to the others (torch.distributed.broadcast of each parameter) before setup")


def _differing(names: list[str], fingerprints: list[torch.Tensor], group) -> list[str]:
    """The names whose ``fingerprints`` differ from their replicas' over ``group``."""
    device = backend.collective_device(group)
    mine = torch.cat([f.to(device) for f in fingerprints]) if fingerprints else torch.zeros(0, dtype=torch.float64,
                                                                                          device=device)
    extremes = torch.cat([mine, -mine])
    backend.all_reduce(extremes, group, op="max")
    highest, lowest = extremes[: len(mine)].cpu(), -extremes[len(mine):].cpu()
    differ = (highest != lowest).view(-1, 2).any(dim=1)
    return [names[i] for i in differ.nonzero().view(-1).tolist()]
