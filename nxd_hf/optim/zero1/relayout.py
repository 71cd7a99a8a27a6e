"""A ZeRO-1 ``state_dict`` saved in the contiguous flat layout loaded into the
interleaved one (``nxd_hf.optim.zero1.flat``): each parameter's state is rebuilt from the saved slices
of every DP rank (one all-reduce per parameter and state, as ``param_states``) and set through
the checkpoint protocol (``load_param_states``). Collective over the sharding group: every DP
rank loads its own saved shard, as it would any ``state_dict``."""

import torch

from nxd_hf import backend
from nxd_hf.checkpoint.optim_state import MASTER
from nxd_hf.optim.zero1.flat import FlatGroup


def is_contiguous_layout(saved_layout: dict) -> bool:
    """A layout recorded before the interleaved one existed (it has no ``interleaved`` key)."""
    return "interleaved" not in saved_layout


def load_contiguous_state_dict(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict(state_dict)`` for a ``state_dict`` in the contiguous layout."""
    old = optimizer._build_flat_groups(1, interleaved=False)
    saved, expected = state_dict["layout"], _contiguous_layout(optimizer, old)
    if saved != expected:
        diff = [k for k in expected if saved.get(k) != expected[k]]
        raise ValueError(
            f"this ZeRO-1 shard was saved for another layout (differs in {diff}): load it with the same "
            "data/tensor/pipeline parallel sizes, parameters and param groups it was saved with")
    inner = state_dict["inner"]
    states = {}
    for index, (fg, master) in enumerate(zip(old, state_dict["masters"])):
        chunk_states = [inner["state"].get(i, {}) for i in inner["param_groups"][index]["params"]]
        flat, scalars = _flat_state(chunk_states)
        flat[MASTER] = master
        group = optimizer.group_of(fg)
        keys = sorted(backend.all_gather_object(sorted(flat), group), key=len)[-1]
        for i, param in enumerate(fg.params):
            state = {key: _gathered(fg, i, flat.get(key), group) for key in keys}
            states[id(param)] = {**state, **scalars}
    optimizer.load_param_states(states)
    for group, options in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update(options)


def _contiguous_layout(optimizer, old: list[FlatGroup]) -> dict:
    return {
        "dp_size": optimizer.dp_size, "dp_rank": optimizer.dp_rank,
        "chunks": [len(group["params"]) for group in optimizer.optimizer.param_groups],
        "groups": [{"group_index": fg.group_index, "dtype": str(fg.dtype), "numel": fg.numel,
                    "shard_numel": fg.shard_numel, "shapes": [list(p.shape) for p in fg.params]} for fg in old],
    }


def _flat_state(chunk_states: list[dict]) -> tuple[dict, dict]:
    """(per-element state over the saved master slice, scalar state) from its chunks' states."""
    flat, scalars = {}, {}
    for key, value in (chunk_states[0].items() if chunk_states else ()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            flat[key] = torch.cat([s[key].reshape(-1) for s in chunk_states])
        else:
            scalars[key] = value if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")  # step
    return flat, scalars


def _gathered(fg: FlatGroup, index: int, source: torch.Tensor | None, group) -> torch.Tensor:
    """``fg.params[index]``'s whole state from the slices of every DP rank."""
    param = fg.params[index]
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    for a, b, at in (fg.param_pieces(index) if source is not None else ()):
        full[a:b] = source[at : at + b - a].to(full.device)
    backend.all_reduce(full, group)
    return full.view(param.shape)
