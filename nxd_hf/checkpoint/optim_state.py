"""The optimizer-state protocol: each parameter's optimizer state in the parameter's own local
layout, out of an optimizer and back in, whatever layout the optimizer keeps it in.

``checkpoint/`` does not import ``optim/``: an optimizer that keeps its state otherwise than a
plain torch optimizer (fp32 masters, ZeRO-1's flat slices over data parallelism) implements
``OptimizerState`` itself (``nxd_hf.optim``: ``NxDOptimizer``, ``NeuronZero1Optimizer``); any
other optimizer is a plain torch optimizer over the model's local parameters, handled here.

A parameter's state is ``{key: tensor}``: every per-element state tensor shaped like the
parameter's local shard, plus ``MASTER`` when the optimizer keeps an fp32 copy of a
low-precision parameter; scalars (Adam's ``step``) stay scalars. ``load_param_states`` takes
that form, so a checkpoint saved with or without ZeRO-1, at any DP size, loads into any optimizer.
"""

from typing import Protocol, runtime_checkable

import torch

from nxd_hf.checkpoint.dp_shard import as_dp_shard, local_of

MASTER = "master"

ParamStates = dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""id(param) -> (param, {key: state tensor in the param's local layout})."""


@runtime_checkable
class OptimizerState(Protocol):
    """What an optimizer with its own state layout answers for (see the module docstring)."""

    shards_state_over_dp: bool
    """Each data-parallel rank holds a slice of the state (ZeRO-1); recorded in the checkpoint."""

    def param_states(self) -> ParamStates:
        """Every trainable parameter's state in its local layout (collective over the sharding
        group when the state is sharded)."""

    def load_param_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Set the state from ``states`` (id(param) -> state as ``param_states`` gives it; a
        parameter missing there keeps none). Masters missing from ``states`` are refreshed from
        the (loaded) parameters."""


def shards_state(optimizer) -> bool:
    return isinstance(optimizer, OptimizerState) and optimizer.shards_state_over_dp


def param_states(optimizer) -> ParamStates:
    if isinstance(optimizer, OptimizerState):
        states = optimizer.param_states()
    else:
        states = {id(p): (p, tensor_state(optimizer.state.get(p, {}))) for g in optimizer.param_groups for p in g["params"]}
    # a parameter FSDP2 shards over DP (ZeRO-2/3) stands in the checkpoint as its local shard (``dp_shard``)
    return {id(local_of(p)): (local_of(p), {k: local_of(v) for k, v in state.items()}) for p, state in states.values()}


def load_param_states(optimizer, states: dict[int, dict]) -> None:
    for p in (p for g in optimizer.param_groups for p in g["params"]):  # keyed by a DP-sharded parameter's local shard
        if local_of(p) is not p and id(local_of(p)) in states:
            states[id(p)] = {k: as_dp_shard(p, v) for k, v in states[id(local_of(p))].items()}
    if isinstance(optimizer, OptimizerState):
        optimizer.load_param_states(states)
        return
    keyed = [(p, {k: v for k, v in states.get(id(p), {}).items() if k != MASTER})
             for g in optimizer.param_groups for p in g["params"]]
    set_torch_state(optimizer, keyed)


def tensor_state(state: dict) -> dict:
    """The tensors of one parameter's torch optimizer state."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def set_torch_state(optimizer: torch.optim.Optimizer, keyed: list[tuple[torch.Tensor, dict]]) -> None:
    """Set a torch optimizer's per-parameter state in place, cast as its ``load_state_dict``
    casts (floating state to the parameter's dtype and device; ``step`` kept). Not through
    ``load_state_dict``: that replaces ``state`` and ``param_groups`` with new objects, which
    wrappers sharing them (and LR schedulers holding them) would no longer see."""
    for param, state in keyed:
        if not state:
            continue
        optimizer.state[param] = {
            key: value.clone() if key == "step" or not value.is_floating_point()
            else value.to(dtype=param.dtype, device=param.device).clone()
            for key, value in state.items()}
