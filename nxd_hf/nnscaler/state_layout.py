"""Where the tensors of a module holding nxd_hf-parallelized parts live, in the original module's
names: the parallel parts (any module with ``model.nxd``: an HF model from ``nxd_hf.parallelize``,
an ``NxDPPModel``, a ``ParallelModule``) and the plain rest around them (nnScaler's Example 2).

A parallel part's local tensors are those of its ``model.nxd.local_modules`` under the names
``model.nxd.hf_model`` gives them (the original module's names), each with its layout: the TP
sharding metadata (``nxd_hf.parallel_layers.sharding``: dim, logical size, logical row of each
local row) and whether it is HF ``Conv1D``'s transpose. Nothing here communicates.
"""

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.hf_safetensors import tied_weights
from nxd_hf.model_state import state_of
from nxd_hf.nnscaler import unused
from nxd_hf.parallel_layers.sharding import is_sharded, shard_from_full


def parallel_parts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state-dict prefix, module) of each outermost parallelized module in ``module`` (itself included)."""
    out = []

    def walk(m, prefix):
        if state_of(m) is not None:
            out.append((prefix, m))
            return
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")
    walk(module, "")
    return out


def root_tensors(root: nn.Module):
    """(name, tensor) of every parameter (tied ones under each name) and persistent buffer of ``root``."""
    yield from root.named_parameters(remove_duplicate=False)
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def local_entries(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(original name, local tensor, in a parallel part) of this rank's parameters and persistent
    buffers; a tied tensor appears under each of its names."""
    out = []

    def walk(m, prefix):
        state = state_of(m)
        if state is not None:
            for root in state.local_modules:
                out.extend((prefix + name, tensor, True) for name, tensor in root_tensors(root))
            return
        out.extend((prefix + n, p, False) for n, p in m._parameters.items() if p is not None)
        out.extend((prefix + n, b, False) for n, b in m._buffers.items()
                   if b is not None and n not in m._non_persistent_buffers_set)
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")
    walk(module, "")
    return out


def unique_entries(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``local_entries`` with each tensor once (under its first name)."""
    seen, out = set(), []
    for name, tensor, parallel in local_entries(module):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor, parallel))
    return out


def original_param_names(module: nn.Module) -> list[str]:
    """The parameter names of the original (unparallelized) module, in its ``parameters()`` order."""
    names, seen = [], set()

    def add(prefix, named):  # a tensor shared by several names counts once, by its first name (as parameters())
        for n, p in named:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                names.append(prefix + n)

    def walk(m, prefix):
        state = state_of(m)
        if state is not None:
            recorded = unused.original_param_names(state.hf_model)  # also the parameters it dropped
            if recorded is not None:
                names.extend(prefix + n for n in recorded)
                seen.update(id(p) for p in state.hf_model.parameters())
            else:
                add(prefix, state.hf_model.named_parameters())
            return
        add(prefix, m._parameters.items())
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")
    walk(module, "")
    return names


def tied_names(module: nn.Module) -> dict[str, str]:
    """Tied name -> source name (original names) of the parallel parts' HF ties (embeddings)."""
    return {prefix + tied: prefix + source for prefix, m in parallel_parts(module)
            for tied, source in tied_weights(state_of(m).hf_model).items()}


def layout_of(tensor: torch.Tensor) -> dict:
    """A local tensor's layout, in plain types and a CPU LongTensor (``torch.load(weights_only=True)`` reads it)."""
    transposed = bool(getattr(tensor, "hf_transposed", False))
    if not is_sharded(tensor):
        return {"dim": None, "transposed": transposed}
    return {"dim": int(tensor.partition_dim), "size": int(tensor.logical_size),
            "rows": tensor.shard_index.detach().to("cpu", copy=True), "transposed": transposed}


def local_piece(layout: dict, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (the original module's tensor) laid out as the local tensor."""
    full = full.t() if layout["transposed"] and full.dim() == 2 else full
    return full if layout["dim"] is None else shard_from_full(full, layout["dim"], layout["rows"])


def assemble(name: str, pieces: list[tuple[dict, torch.Tensor]]) -> torch.Tensor:
    """The original module's tensor from local pieces (any replicas; every logical row at least once)."""
    layout, first = pieces[0]
    if layout["dim"] is None or first.dim() == 0:
        whole = first.detach().clone()
        return whole.t() if layout["transposed"] and whole.dim() == 2 else whole
    dim, size = layout["dim"], layout["size"]
    shape = list(first.shape)
    shape[dim] = size
    full = first.new_zeros(shape)
    filled = torch.zeros(size, dtype=torch.bool, device="cpu")  # indexed by the host shard indices
    for piece_layout, piece in pieces:
        rows = piece_layout["rows"]
        real = (rows >= 0).nonzero().flatten()
        full.index_copy_(dim, rows[real].to(full.device), piece.detach().index_select(dim, real.to(piece.device)))
        filled[rows[real]] = True
    if not bool(filled.all()):
        raise ValueError(f"{name}: rows {(~filled).nonzero().flatten().tolist()[:8]} are in none of the state dicts "
                         "given: pass the state dicts of every rank")
    return full.t() if layout["transposed"] and full.dim() == 2 else full


def rank_info() -> dict:
    """This rank's place in the parallel layout."""
    info = {"rank": backend.rank(), "world_size": backend.world_size()}
    for kind, size, rank in (
        ("tp", parallel_state.get_tensor_model_parallel_size, parallel_state.get_tensor_model_parallel_rank),
        ("pp", parallel_state.get_pipeline_model_parallel_size, parallel_state.get_pipeline_model_parallel_rank),
        ("dp", parallel_state.get_data_parallel_size, parallel_state.get_data_parallel_rank),
    ):
        info[f"{kind}_size"], info[f"{kind}_rank"] = size(), rank()
    return info
