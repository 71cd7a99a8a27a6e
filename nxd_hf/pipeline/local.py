"""What happens to this rank's stages after the split: materializing meta parameters (only
local ones ever get memory), tying weights shared across stages, activation checkpointing."""

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from nxd_hf import backend, parallel_state


def _owners(modules: list[nn.Module]) -> dict[int, list[tuple[nn.Module, str]]]:
    owners = {}
    for root in modules:
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    owners.setdefault(id(param), []).append((module, name))
    return owners


def materialize(stage_modules: list[nn.Module], param_init_fn=None) -> None:
    """Allocate the local stages' meta parameters on CPU (metadata and ties kept), then let
    ``param_init_fn(module)`` initialize each module's own parameters."""
    owners = _owners(stage_modules)
    touched = []
    for param_id, holders in owners.items():
        module, name = holders[0]
        param = getattr(module, name)
        if not param.is_meta:
            continue
        new = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        for owner, attr in holders:
            setattr(owner, attr, new)
            touched.append(owner)
    for root in stage_modules:
        for module in root.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    from nxd_hf.checkpoint.hf_safetensors import _rebuild_buffers

                    _rebuild_buffers(module, type(module).__name__)
    if touched and param_init_fn is None:
        raise ValueError("the model has meta-device parameters: pass param_init_fn to initialize them "
                         "(or load weights with nxd_hf.from_pretrained)")
    if param_init_fn is not None:
        seen = set()
        for root in stage_modules:
            for module in root.modules():
                if id(module) not in seen:
                    seen.add(id(module))
                    param_init_fn(module)


class TiedParameters:
    """Parameters held by stages on different PP ranks (tied embeddings): one group per tie
    over those ranks (and this rank's TP/DP coordinates); gradients are summed over it, values
    broadcast from the first holder at setup, and only the first holder counts in the norm."""

    def __init__(self):
        self.local: list[tuple] = []  # (name, first holder's global rank, group, local stages holding it)

    def _param(self, stages, name):
        return dict(p for stage in stages for p in stage.named_parameters(remove_duplicate=False))[name]

    def sync_initial_values(self) -> None:
        for name, src, group, stages in self.local:
            backend.broadcast(self._param(stages, name).data, src, group)

    def sum_grads(self) -> None:
        from nxd_hf.optim.mixed_precision import accumulated_grad

        for name, _, group, stages in self.local:
            param = self._param(stages, name)
            if accumulated_grad(param) is None:
                param.grad = torch.zeros_like(param)
            backend.all_reduce(accumulated_grad(param), group)


def tie_across_stages(all_stages: list[nn.Module], stage_to_rank: list[int], local_ids: list[int]) -> TiedParameters:
    """Find parameters shared by stages on different PP ranks and create their groups (every
    rank creates every group, in the same order)."""
    holders = {}
    for stage_id, stage in enumerate(all_stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append((stage_id, name))
    tied = TiedParameters()
    pp_lists = parallel_state.get_pipeline_model_parallel_group(as_list=True)
    me = backend.rank()
    for entries in holders.values():
        pp_ranks = sorted({stage_to_rank[s] for s, _ in entries})
        if len(pp_ranks) < 2:
            continue
        for pipeline in pp_lists:
            ranks = [pipeline[r] for r in pp_ranks]
            group = backend.new_group(ranks, timeout=parallel_state.get_collective_timeout(), name="tied-weights (pp)")
            if me not in ranks:
                continue
            local = [(s, n) for s, n in entries if s in local_ids]
            first_stage = min(s for s, _ in entries)
            name = local[0][1]
            param_stages = [all_stages[s] for s, _ in local]
            if min(s for s, _ in local) != first_stage:
                for stage in param_stages:  # counted in the grad norm on the first holder only
                    dict(stage.named_parameters(remove_duplicate=False))[name].count_in_grad_norm = False
            tied.local.append((name, ranks[0], group, param_stages))
    return tied


def checkpoint_layers(stage_modules: list[nn.Module], config, layer_types: tuple[type, ...]) -> None:
    """Recompute the chosen layers in backward: ``config`` is "full" (every transformer layer),
    a module class, or a list of classes."""
    if config == "full":
        types = layer_types
    elif isinstance(config, type):
        types = (config,)
    elif isinstance(config, (list, tuple)) and all(isinstance(c, type) for c in config):
        types = tuple(config)
    else:
        raise ValueError(f"activation_checkpoint_config must be 'full', a module class or a list of classes, "
                         f"not {config!r}")
    for root in stage_modules:
        for module in root.modules():
            if isinstance(module, types) and not getattr(module, "_nxd_checkpointed", False):
                forward = module.forward
                module.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
                module._nxd_checkpointed = True
