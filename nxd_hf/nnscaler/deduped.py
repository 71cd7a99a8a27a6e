"""nnScaler's deduped state dicts: ``deduped_state_dict`` (what this rank keeps of the whole
state, each logical row by one rank) and ``load_deduped_state_dict`` (every rank's deduped dict
back into a module and optimizer at any parallel layout).

The pieces are the checkpoint format's (``nxd_hf.checkpoint``: ``logical.describe`` picks the
rows a rank owns, ``format.parts_of`` cuts them): each is the run ``[start, stop)`` of logical
rows along the sharded dim (or the whole tensor) under the original module's name, in on-disk
orientation; optimizer state as ``<name>::<key>``. The ``NXD_HF_EXTRA_STATE`` entry lists them.
"""

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import optim_state
from nxd_hf.checkpoint.format import dtype_name, parts_of
from nxd_hf.checkpoint.logical import describe
from nxd_hf.checkpoint.save import OPTIM_SEP
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.nnscaler.state_dicts import EXTRA_STATE_KEY, add_extra_state_hooks, load_group_options
from nxd_hf.nnscaler.state_layout import layout_of, local_entries, local_piece, rank_info, tied_names, unique_entries


def _owned(entries, owner) -> list:
    """``LogicalTensor``s of ``entries`` whose rows this rank keeps (collective over TP): a
    parallel part's rows by their first TP holder on the ranks ``owner(i)`` picks (a weight's
    copy tied across stages never), the plain rest by rank 0."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = []
    for i, (name, tensor, parallel) in enumerate(entries):
        if parallel:
            out.append(describe(name, name, tensor, tp_rank, owner(i) and getattr(tensor, "count_in_grad_norm", True)))
        else:
            out.append(describe(name, name, tensor, 0, backend.rank() == 0))
    return out


def _pieces(lts, states: dict | None) -> tuple[dict, dict]:
    """({piece key: tensor}, {name: {shape, dtype, parts}}) of what this rank keeps of the tensors
    (``states`` None) or of their optimizer states (``name::key``)."""
    tensors, index = {}, {}
    for lt in lts:
        if states is None:
            items = [(lt.name, lt.tensor)]
        else:
            items = [(f"{lt.name}{OPTIM_SEP}{k}", v) for k, v in states.get(id(lt.tensor), (None, {}))[1].items()]
        for name, value in items:
            parts = parts_of(lt, value, name, "")
            if not parts:
                continue
            shape = list(lt.shape) if value.dim() and value.shape == lt.tensor.shape else list(value.shape)
            entry = index.setdefault(name, {"shape": shape, "dtype": dtype_name(value.dtype), "parts": []})
            for key, piece, part in parts:
                tensors[key] = piece.clone()
                entry["parts"].append({k: part[k] for k in ("key", "dim", "start", "stop")})
    return tensors, index


@torch.no_grad()
def deduped_state_dict(module: nn.Module, optimizer=None) -> tuple[dict, dict | None]:
    """(module part, optimizer part or None) of the whole state that this rank keeps: each logical
    row once, by the lowest rank holding it (data-parallel rank 0, the first TP holder, the first
    pipeline stage of a tied weight); under ZeRO-1 the optimizer state of each parameter by one
    data-parallel rank in turn (about 1/dp each). Keys are the checkpoint format's pieces
    (``name@row`` along the sharded dim, or ``name``; optimizer ``name::key``), described under
    ``NXD_HF_EXTRA_STATE``. Collective: every rank calls it."""
    add_extra_state_hooks(module)
    entries = unique_entries(module)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    tensors, index = _pieces(_owned(entries, lambda i: dp_rank == 0), None)
    module_sd = {**tensors, EXTRA_STATE_KEY: {"version": 1, "kind": "deduped", **rank_info(), "tensors": index}}
    if optimizer is None:
        return module_sd, None
    states = optim_state.param_states(optimizer)  # collective under ZeRO-1
    zero = optim_state.shards_state(optimizer)
    tensors, index = _pieces(_owned(entries, lambda i: (i % dp_size == dp_rank) if zero else dp_rank == 0), states)
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    extra = {"version": 1, "kind": "deduped", **rank_info(), "tensors": index,
             "group_options": options if backend.rank() == 0 else None}
    return module_sd, {**tensors, EXTRA_STATE_KEY: extra}


def _gathered(state_dict: dict, device):
    """(name, whole tensor) for every name any rank's deduped ``state_dict`` holds, in one order on
    every rank (one all-reduce each: every row is kept by exactly one rank). Collective."""
    index = (state_dict or {}).get(EXTRA_STATE_KEY, {}).get("tensors", {})
    union = {}
    for other in backend.all_gather_object({n: (e["shape"], e["dtype"]) for n, e in index.items()}):
        union.update(other)

    def generate():
        for name in sorted(union):
            shape, dtype = union[name]
            full = torch.zeros(shape, dtype=getattr(torch, dtype), device=backend.collective_device())
            for part in index.get(name, {}).get("parts", []):
                piece = state_dict[part["key"]]
                target = full if part["dim"] is None else full.narrow(part["dim"], part["start"], part["stop"] - part["start"])
                target.copy_(piece)
            backend.all_reduce(full, None)
            yield name, (full if device is None else full.to(device))
    return union, generate()


def _resolve(names, union: dict, tied: dict, what: str) -> dict[str, str]:
    """Local name -> the saved name holding it (itself, or the weight it is tied to); collective."""
    resolved = {n: (n if n in union else tied.get(n)) for n in names}
    missing = sorted(n for n, r in resolved.items() if r not in union) if union else []  # no state saved: none
    with fail_together("load_deduped_state_dict"):
        if missing:
            raise ValueError(f"the deduped {what} state dicts hold no {missing[:8]} ({len(missing)} tensors): pass every "
                             "rank's deduped_state_dict() of this module (any parallel layout)")
    return resolved


@torch.no_grad()
def load_deduped_state_dict(module: nn.Module, module_state_dict: dict, optimizer=None,
                            optimizer_state_dict: dict | None = None, *, device=None) -> None:
    """Load what ``deduped_state_dict`` returned on every rank (each rank passes its own; the
    layout may differ from the saving one: any tp/pp/dp, ZeRO-1 or not, same world size or
    not: a rank past the saving world passes None). ``device``: where whole tensors are
    assembled before slicing (default: the collective device). Collective."""
    entries, tied = local_entries(module), tied_names(module)
    union, gathered = _gathered(module_state_dict, device)
    resolved = _resolve({n for n, _, _ in entries}, union, tied, "module")
    wanted = {}
    for name, tensor, _ in entries:
        wanted.setdefault(resolved[name], []).append(tensor)
    for name, full in gathered:
        for tensor in wanted.get(name, []):
            tensor.copy_(local_piece(layout_of(tensor), full))
    if optimizer is None:
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = [(n, t) for n, t, _ in unique_entries(module) if id(t) in held]
    union, gathered = _gathered(optimizer_state_dict, device)
    bases = {name.rsplit(OPTIM_SEP, 1)[0] for name in union}
    resolved = _resolve({n for n, _ in params}, {b: None for b in bases}, tied, "optimizer")
    wanted = {}
    for name, tensor in params:
        wanted.setdefault(resolved[name], []).append(tensor)
    states = {}
    for name, full in gathered:
        base, key = name.rsplit(OPTIM_SEP, 1)
        for tensor in wanted.get(base, []):
            value = full if full.dim() == 0 else local_piece(layout_of(tensor), full)
            states.setdefault(id(tensor), {})[key] = value.to(tensor.device)
    optim_state.load_param_states(optimizer, states)
    options = next(o for o in backend.all_gather_object(
        (optimizer_state_dict or {}).get(EXTRA_STATE_KEY, {}).get("group_options")) if o is not None)
    load_group_options(optimizer, [{**o, "params": []} for o in options])
