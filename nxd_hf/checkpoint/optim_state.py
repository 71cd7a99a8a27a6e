"""Optimizer state per parameter, in the parameter's own local layout, for any optimizer.

Three kinds are recognized by duck typing (``checkpoint/`` does not import ``optim/`` or
``trainer/``):

- a plain torch optimizer over the model's (local) parameters;
- an optimizer over fp32 masters (``NxDOptimizer``): ``masters`` is a list of objects with
  ``params`` and ``masters``, ``optimizer`` the inner torch optimizer;
- ZeRO-1 (``NeuronZero1Optimizer``): ``flat_groups`` lay the parameters end to end and each
  DP rank holds a slice of the fp32 masters (``masters``) and of the inner optimizer's state
  (``optimizer``, whose params are chunks of the master slices).

``param_states`` returns, for each trainable parameter, ``{key: tensor}`` with every
per-element state tensor shaped like the parameter's local shard (ZeRO-1's slices are summed
over DP into it, one parameter at a time) plus ``"master"`` when the optimizer keeps an fp32
copy of a low-precision parameter; scalars (Adam's ``step``) stay scalars.
``install_param_states`` is the inverse: it takes this rank's ZeRO-1 slice of each, so a
checkpoint saved with or without ZeRO-1, at any DP size, loads into any of the three.
"""

import torch

from nxd_hf import backend

MASTER = "master"


def kind(optimizer) -> str:
    if hasattr(optimizer, "flat_groups") and hasattr(optimizer, "masters"):
        return "zero1"
    if hasattr(optimizer, "masters") and hasattr(optimizer, "optimizer"):
        return "masters"
    return "plain"


def _tensor_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def param_states(optimizer) -> dict[int, tuple[torch.Tensor, dict]]:
    """id(param) -> (param, {key: state tensor in the param's local layout})."""
    which = kind(optimizer)
    if which == "zero1":
        return _zero1_states(optimizer)
    out = {}
    if which == "masters":
        for group in optimizer.masters:
            for param, master in zip(group.params, group.masters):
                state = _tensor_state(optimizer.optimizer.state.get(master, {}))
                if master is not param:
                    state[MASTER] = master.detach()
                out[id(param)] = (param, state)
        return out
    for group in optimizer.param_groups:
        for param in group["params"]:
            out[id(param)] = (param, _tensor_state(optimizer.state.get(param, {})))
    return out


def _slice_state(optimizer, index: int) -> tuple[dict, dict]:
    """(per-element state over this rank's master slice ``index``, scalar state) of ZeRO-1."""
    chunks = optimizer.optimizer.param_groups[index]["params"]
    states = [optimizer.optimizer.state.get(c, {}) for c in chunks]
    flat, scalars = {}, {}
    for key, value in (states[0].items() if states else ()):
        if not isinstance(value, torch.Tensor):
            continue
        if value.numel() == chunks[0].numel() and value.dim() > 0:
            flat[key] = torch.cat([s[key].reshape(-1) for s in states])
        else:
            scalars[key] = value
    return flat, scalars


def _zero1_states(optimizer) -> dict[int, tuple[torch.Tensor, dict]]:
    out = {}
    for index, (fg, master) in enumerate(zip(optimizer.flat_groups, optimizer.masters)):
        flat, scalars = _slice_state(optimizer, index)
        keys = sorted(backend.all_gather_object(sorted(flat), optimizer.sharding_group), key=len)[-1]
        sources = {key: flat.get(key) for key in keys}
        if fg.dtype != torch.float32:
            sources[MASTER] = master.detach()
        scalar_keys = sorted(backend.all_gather_object(sorted(scalars), optimizer.sharding_group), key=len)[-1]
        lo, hi = fg.shard_start, fg.shard_start + fg.shard_numel
        for param, offset in zip(fg.params, fg.offsets):
            state = {}
            for key, source in sources.items():
                full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                a, b = max(lo, offset), min(hi, offset + param.numel())
                if a < b and source is not None:
                    full[a - offset : b - offset] = source[a - lo : b - lo]
                backend.all_reduce(full, optimizer.sharding_group)  # each element comes from one rank
                state[key] = full.view(param.shape)
            state.update({key: _agreed_scalar(scalars.get(key), optimizer.sharding_group) for key in scalar_keys})
            out[id(param)] = (param, state)
    return out


def _agreed_scalar(value: torch.Tensor | None, group) -> torch.Tensor:
    """A scalar every DP rank holds equal (``step``); a rank without state holds none."""
    values = [v for v in backend.all_gather_object(value, group) if v is not None]
    return values[0].clone()


def install_param_states(optimizer, states: dict[int, dict]) -> None:
    """Set the optimizer state from ``states`` (id(param) -> {key: tensor in the param's local
    layout}); masters missing from ``states`` are refreshed from the (loaded) parameters."""
    which = kind(optimizer)
    if which == "zero1":
        _install_zero1(optimizer, states)
        return
    if which == "masters":
        keyed = []
        with torch.no_grad():
            for group in optimizer.masters:
                for param, master in zip(group.params, group.masters):
                    state = dict(states.get(id(param), {}))
                    saved_master = state.pop(MASTER, None)
                    if master is not param:
                        master.copy_(saved_master if saved_master is not None else param)
                    keyed.append((master, state))
        _load_inner(optimizer.optimizer, keyed)
        return
    keyed = [(p, {k: v for k, v in states.get(id(p), {}).items() if k != MASTER})
             for g in optimizer.param_groups for p in g["params"]]
    _load_inner(optimizer, keyed)


def _load_inner(optimizer, keyed: list[tuple[torch.Tensor, dict]]) -> None:
    """Set the torch optimizer's per-parameter state in place, cast as its ``load_state_dict``
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


def _install_zero1(optimizer, states: dict[int, dict]) -> None:
    keyed = []
    for index, (fg, master) in enumerate(zip(optimizer.flat_groups, optimizer.masters)):
        lo, hi = fg.shard_start, fg.shard_start + fg.shard_numel
        flat, scalars = {}, {}
        with torch.no_grad():
            for param, offset in zip(fg.params, fg.offsets):
                a, b = max(lo, offset), min(hi, offset + param.numel())
                state = states.get(id(param), {})
                if a < b:
                    src = state.get(MASTER, param).reshape(-1)
                    master[a - lo : b - lo] = src[a - offset : b - offset].float()
                for key, value in state.items():
                    if key == MASTER:
                        continue
                    if value.dim() == 0 or value.numel() != param.numel():
                        scalars.setdefault(key, value)
                        continue
                    buffer = flat.setdefault(key, torch.zeros(fg.shard_numel, dtype=torch.float32, device=master.device))
                    if a < b:
                        buffer[a - lo : b - lo] = value.reshape(-1)[a - offset : b - offset]
        chunks = optimizer.optimizer.param_groups[index]["params"]
        pieces = {key: buffer.split([c.numel() for c in chunks]) for key, buffer in flat.items()}
        keyed += [(c, {**{k: p[i].clone() for k, p in pieces.items()}, **{k: v.clone() for k, v in scalars.items()}})
                  for i, c in enumerate(chunks)]
    _load_inner(optimizer.optimizer, keyed)
