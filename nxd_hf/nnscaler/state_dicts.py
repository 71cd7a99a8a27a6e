"""nnScaler's merged state dicts: ``merge_state_dicts`` (every rank's ``module.state_dict()`` and
``optimizer.state_dict()`` in, the original module's state dict and its Adam-like optimizer state
out) and ``load_merged_state_dicts`` (each rank takes its part back).

Offline merging needs each rank's layout, so a parallelized module's ``state_dict()`` carries it
under the extra key ``<prefix>NXD_HF_EXTRA_STATE`` (nnScaler's ``CUBE_EXTRA_STATE``), added by a
``state_dict`` post-hook that ``add_extra_state_hooks`` registers (``build_optimizer`` and
``deduped_state_dict`` register it too) and dropped by a ``load_state_dict`` pre-hook, so the
module's own ``load_state_dict`` takes such a dict. It holds the rank's place (tp/pp/dp ranks and
sizes), for each state-dict key the original name and layout (sharded dim, logical size, logical
row of each local row, Conv1D transpose; ``state_layout.layout_of``), the original parameter
order and HF's tied names. ``build_optimizer``'s optimizers add theirs (``optimizer.py``):
the optimizer's class, each parameter's original name by optimizer index (or ZeRO-1's flat
layout: names, offsets, local shapes and each DP rank's slice), the param groups' names.
"""

import torch
from torch import nn

from nxd_hf.checkpoint import optim_state
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.model_state import state_of
from nxd_hf.nnscaler.state_layout import (
    assemble, layout_of, local_entries, local_piece, original_param_names, parallel_parts, rank_info, root_tensors,
    tied_names,
)

EXTRA_STATE_KEY = "NXD_HF_EXTRA_STATE"
_HOOKED = "_nxd_hf_extra_state_hooks"


def module_extra_state(module: nn.Module, paths: dict[int, str] | None = None) -> dict:
    """The layout record of one parallelized module (see the module docstring); ``paths``: the
    state-dict path of each local module by ``id(local._parameters)`` (default: its module path)."""
    state = state_of(module)
    # keyed by the parameter dict: a module that adopted another's (ParallelModule) stands for it
    if paths is None:
        paths = {id(m._parameters): name for name, m in module.named_modules(remove_duplicate=False)}
    names, layouts = {}, {}
    for root in state.local_modules:
        assert id(root._parameters) in paths, "model.nxd.local_modules must be (adopted) submodules of the model"
        path = paths[id(root._parameters)]
        base = f"{path}." if path else ""
        for name, tensor in root_tensors(root):
            names[base + name], layouts[base + name] = name, layout_of(tensor)
    return {"version": 1, **rank_info(), "names": names, "layouts": layouts,
            "param_names": original_param_names(module), "tied": tied_names(module)}


def _add_extra_state(module, state_dict, prefix, local_metadata) -> None:
    state_dict[prefix + EXTRA_STATE_KEY] = module_extra_state(module)


def _drop_extra_state(module, state_dict, prefix, *args) -> None:
    state_dict.pop(prefix + EXTRA_STATE_KEY, None)


def add_extra_state_hooks(module: nn.Module) -> None:
    """Make every parallelized part of ``module`` put its layout into its ``state_dict()`` (once)."""
    for _, part in parallel_parts(module):
        if not getattr(part, _HOOKED, False):
            part.register_state_dict_post_hook(_add_extra_state)
            part.register_load_state_dict_pre_hook(_drop_extra_state)
            setattr(part, _HOOKED, True)


def _is_extra(key: str) -> bool:
    return key == EXTRA_STATE_KEY or key.endswith("." + EXTRA_STATE_KEY)


def _split(module_state_dicts: list[dict]):
    """({rank: {full name: layout}}, {full name: [(layout, tensor)]}, {plain key: tensor}, {rank: {prefix: extra}})."""
    layouts, pieces, plain, extras = {}, {}, {}, {}
    for state_dict in module_state_dicts:
        mine = {key[: -len(EXTRA_STATE_KEY)]: value for key, value in state_dict.items() if _is_extra(key)}
        if not mine:
            raise ValueError("a module state dict has no NXD_HF_EXTRA_STATE key: take the state dicts from modules given "
                             "to nxd_hf.nnscaler.build_optimizer or add_extra_state_hooks before calling state_dict()")
        rank = next(iter(mine.values()))["rank"]
        extras[rank], layouts[rank] = mine, {}
        for key, value in state_dict.items():
            if _is_extra(key):
                continue
            prefix = next((p for p, e in mine.items() if key.startswith(p) and key[len(p):] in e["names"]), None)
            if prefix is None:
                plain.setdefault(key, value)  # outside the parallel parts: the same on every rank
                continue
            full, layout = prefix + mine[prefix]["names"][key[len(prefix):]], mine[prefix]["layouts"][key[len(prefix):]]
            layouts[rank][full] = layout
            pieces.setdefault(full, []).append((layout, value))
    world = next(iter(next(iter(extras.values())).values()))["world_size"]
    if sorted(extras) != list(range(world)):
        raise ValueError(f"merge_state_dicts got the state dicts of ranks {sorted(extras)} of a world of {world}: "
                         "pass every rank's state dict, once each")
    return layouts, pieces, plain, extras


@torch.no_grad()
def merge_state_dicts(module_state_dicts: list[dict], optimizer_state_dicts: list[dict] | None = None):
    """(the original module's state dict, its optimizer state dict or None) from every rank's
    ``module.state_dict()`` / ``optimizer.state_dict()`` (any order). The optimizer state is
    torch's format over the original module's ``parameters()`` order (the state of an optimizer
    with per-element state: Adam, AdamW, SGD momentum...; fp32 masters of bf16 parameters are
    not kept)."""
    if not module_state_dicts:
        raise ValueError("merge_state_dicts needs the module state dicts of every rank (got none)")
    layouts, pieces, plain, extras = _split(module_state_dicts)
    merged = {name: assemble(name, parts) for name, parts in pieces.items()}
    merged.update({k: v for k, v in plain.items() if k not in merged})
    if optimizer_state_dicts is None:
        return merged, None
    if len(optimizer_state_dicts) != len(module_state_dicts):
        raise ValueError(f"got {len(module_state_dicts)} module and {len(optimizer_state_dicts)} optimizer state "
                         "dicts: pass both for every rank")
    for osd in optimizer_state_dicts:
        if EXTRA_STATE_KEY not in osd:
            raise ValueError("an optimizer state dict has no NXD_HF_EXTRA_STATE key: build the optimizer with "
                             "nxd_hf.nnscaler.build_optimizer")
    by_rank = {osd[EXTRA_STATE_KEY]["rank"]: osd for osd in optimizer_state_dicts}
    return merged, _merge_optimizer(by_rank, layouts, local_optimizer_states(by_rank))


def _merge_optimizer(by_rank: dict, layouts: dict, states: dict) -> dict:
    """torch's optimizer state dict over the original parameter order, from each rank's local states."""
    extra = by_rank[0][EXTRA_STATE_KEY]
    order = {name: i for i, name in enumerate(extra["param_names"])}
    tied = extra["tied"]
    held = {name for local in states.values() for name in local}
    per_param: dict[str, dict[str, list]] = {}
    for rank, local in states.items():
        for name, state in local.items():
            target = name if name in order else tied.get(name)
            if target not in order or (target != name and target in held):
                continue  # not a parameter of the original, or a stage's copy of a tied weight held as such
            for key, value in state.items():
                per_param.setdefault(target, {}).setdefault(key, []).append((layouts[rank].get(name, _WHOLE), value))
    out_state = {}
    for name, keyed in per_param.items():
        out_state[order[name]] = {key: _merged_value(f"{name}::{key}", values) for key, values in keyed.items()}
    groups, listed = [], set()
    for g, options in enumerate(extra["group_options"]):
        names = {n for osd in by_rank.values() for n in osd[EXTRA_STATE_KEY]["groups"][g]}
        indices = sorted({order.get(n, order.get(tied.get(n))) for n in names} - {None})
        groups.append({**options, "params": indices})
        listed.update(indices)
    # As nnScaler's: every parameter of the original module is listed, also those no rank holds
    # (unused, dropped by the trace), so an optimizer over the original parameters() loads it.
    rest = set(range(len(order))) - listed
    if rest and groups:
        groups[0]["params"] = sorted(groups[0]["params"] + list(rest))
    return {"state": dict(sorted(out_state.items())), "param_groups": groups}


_WHOLE = {"dim": None, "transposed": False}


def _merged_value(name: str, values: list):
    layout, first = values[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return first.clone() if isinstance(first, torch.Tensor) else first
    return assemble(name, values)


@torch.no_grad()
def load_merged_state_dicts(module: nn.Module, module_state_dict: dict, optimizer=None,
                            optimizer_state_dict: dict | None = None, *, device=None) -> None:
    """Each rank copies its part of a merged (original-module) state dict into ``module`` and,
    given, its optimizer (any nxd_hf layout, with or without ZeRO-1). ``device``: where the
    whole tensors are sliced (default: where they are); the parts land on the local tensors'
    devices. Every rank calls it."""
    entries = local_entries(module)
    with fail_together("load_merged_state_dicts"):
        missing = sorted({n for n, _, _ in entries if n not in module_state_dict})
        if missing:
            raise ValueError(f"the merged state dict lacks {missing[:8]} ({len(missing)} keys): merge the state dicts "
                             "of this module (merge_state_dicts) or pass the original module's state_dict()")
    for name, tensor, _ in entries:
        full = module_state_dict[name]
        full = full if device is None else full.to(device)
        tensor.copy_(local_piece(layout_of(tensor), full))
    if optimizer is None:
        return
    if optimizer_state_dict is None:
        raise ValueError("load_merged_state_dicts got an optimizer without optimizer_state_dict: pass both, or neither")
    order = {name: i for i, name in enumerate(original_param_names(module))}
    tied, saved = tied_names(module), optimizer_state_dict["state"]
    states = {}
    for name, tensor, _ in entries:
        index = order.get(name, order.get(tied.get(name)))
        if index is None or index not in saved or id(tensor) in states:
            continue
        layout = layout_of(tensor)
        states[id(tensor)] = {key: _local_state(layout, value, tensor, device) for key, value in saved[index].items()}
    optim_state.load_param_states(optimizer, states)
    load_group_options(optimizer, optimizer_state_dict["param_groups"])


def _local_state(layout: dict, value, tensor: torch.Tensor, device):
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32, device="cpu")
    value = value if device is None else value.to(device)
    return local_piece(layout, value).to(tensor.device)


def load_group_options(optimizer, saved_groups: list[dict]) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer state has {len(saved_groups)} param groups, this optimizer "
                         f"{len(optimizer.param_groups)}: build the optimizer with the same param groups")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def local_optimizer_states(by_rank: dict[int, dict]) -> dict[int, dict[str, dict]]:
    """{rank: {original name: {key: state in the parameter's local layout}}} from ``build_optimizer``'s
    state dicts; a ZeRO-1 position's slices (one per data-parallel rank) become whole local states,
    filed under its lowest rank."""
    out, zero_positions = {}, {}
    for rank, osd in by_rank.items():
        extra = osd[EXTRA_STATE_KEY]
        if extra["kind"] == "plain":
            out[rank] = {extra["params"][i]: dict(state) for i, state in osd["state"].items()}
        else:
            zero_positions.setdefault((extra["tp_rank"], extra["pp_rank"]), []).append((rank, osd))
    for members in zero_positions.values():
        dp = members[0][1][EXTRA_STATE_KEY]["dp_size"]
        if len(members) != dp:
            raise ValueError(f"the ZeRO-1 state of ranks {[r for r, _ in members]} lacks data-parallel ranks: pass "
                             "every rank's optimizer.state_dict()")
        out[min(r for r, _ in members)] = _zero_states([osd for _, osd in members])
    return out


def _zero_states(osds: list[dict]) -> dict[str, dict]:
    """Whole local states of one (tp, pp) position from its data-parallel ranks' ZeRO-1 slices."""
    out = {}
    for k, fg in enumerate(osds[0][EXTRA_STATE_KEY]["flat_groups"]):
        flat, scalars = {}, {}
        for osd in osds:
            mine = osd[EXTRA_STATE_KEY]["flat_groups"][k]
            inner = osd["inner"]
            states = [inner["state"].get(c) for c in inner["param_groups"][k]["params"]]
            if not states or states[0] is None:
                continue
            pieces = mine.get("pieces") or [(mine["shard_start"], mine["shard_start"] + mine["shard_numel"], 0)]
            for key, value in states[0].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    piece = torch.cat([s[key].reshape(-1) for s in states])
                    buffer = flat.setdefault(key, piece.new_zeros(len(osds) * mine["shard_numel"]))
                    for lo, hi, at in pieces:  # the flat ranges this rank holds, at their place in its slice
                        buffer[lo:hi] = piece[at : at + hi - lo]
                else:
                    scalars.setdefault(key, value)
        # no gradient on any rank and zero state: stepped by ZeRO-1 only, torch's optimizer has no state for it
        no_grad = set.intersection(*(set(osd[EXTRA_STATE_KEY]["flat_groups"][k].get("no_grad", ())) for osd in osds))
        for name, offset, shape in zip(fg["names"], fg["offsets"], fg["shapes"]):
            size = torch.Size(shape).numel()
            tensors = {key: b[offset : offset + size].view(shape).clone() for key, b in flat.items()}
            if name in no_grad and not any(bool(t.any()) for t in tensors.values()):
                continue
            out[name] = {**tensors, **scalars}
    return out


# nnScaler's own name for it (the reference document uses both).
load_merged_state_dict = load_merged_state_dicts
