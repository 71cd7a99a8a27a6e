"""Weights shared by pipeline stages on different ranks (tied embeddings)."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.grads import accumulated_grad


class TiedParameters:
    """Parameters held by stages on different PP ranks (tied embeddings): one group per tie
    over those ranks (and this rank's TP/DP coordinates); gradients are summed over it (under
    ZeRO-2/3 the DP shards, after FSDP2's reduce-scatter at the end of the step), values
    broadcast from the first holder at setup, and only the first holder counts in the norm."""

    def __init__(self):
        self.local: list[tuple] = []  # (name, first holder's global rank, group, local stages holding it)
        self._before: dict[str, torch.Tensor | None] | None = None  # each gradient as the step found it

    def _param(self, stages, name):
        return dict(p for stage in stages for p in stage.named_parameters(remove_duplicate=False))[name]

    @torch.no_grad()
    def sync_initial_values(self) -> None:
        for name, src, group, stages in self.local:
            param = self._param(stages, name)
            # sharded over DP by FSDP2: every holder's DP rank d has the same rows (sum_grads)
            backend.broadcast(param.to_local() if isinstance(param, DTensor) else param.data, src, group)

    @torch.no_grad()
    def begin_step(self) -> None:
        """Keep each tied gradient as it is before a training step: ``sum_grads`` then sums only
        the step's part over the tie group (a gradient accumulated over several ``run_train``
        calls was already summed for the earlier ones)."""
        self._before = {}
        for name, _, _, stages in self.local:
            param = self._param(stages, name)
            if not param.requires_grad:
                continue
            grad = accumulated_grad(param)
            self._before[name] = None if grad is None else _local(grad).clone()

    @torch.no_grad()
    def sum_grads(self) -> None:
        before, self._before = self._before or {}, None
        for name, _, group, stages in self.local:
            param = self._param(stages, name)
            # frozen (LoRA's base: peft freezes it on every stage alike): no gradient, as in plain peft;
            # a zero one would let an optimizer over all parameters decay the frozen weight
            if not param.requires_grad:
                continue
            if accumulated_grad(param) is None:
                param.grad = torch.zeros_like(param)
            grad = _local(accumulated_grad(param))
            earlier = before.get(name)
            if earlier is not None:
                grad.sub_(earlier)
            backend.all_reduce(grad, group)
            if earlier is not None:
                grad.add_(earlier)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's tensor on this rank: sharded over DP by FSDP2 (nxd_hf.fsdp), every holder's
    DP rank d has the same rows."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


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
