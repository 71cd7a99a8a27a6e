"""The logical-tensor protocol: what of each local tensor a checkpoint stores, and where.

A ``LogicalTensor`` describes one local parameter or buffer in the coordinates of the file a
plain ``save_pretrained`` would write: its on-disk name (HF's load-time renames undone), its
unsharded, unpadded shape, the dim it is sharded on and the logical row of each local row
(``shard_index``, -1 for padding), whether the local tensor is the transpose of the on-disk one
(HF ``Conv1D``), and the runs of local rows this rank writes. Each logical row is written once:
replicated tensors by TP rank 0, replicated K/V rows by the first TP rank holding them, a
weight tied across pipeline stages by its first holder (the others carry
``count_in_grad_norm = False``), padding never; data-parallel replicas take turns by tensor.
An expert-parallel tensor (``sharding.is_expert_parallel``: a fused experts tensor split over the
expert-parallel group) is sharded along its expert dim 0 with ``rows`` its experts; each rank
writes its own experts, the replicas holding the same experts (the expert-data group) take turns.
When TP also shards it (each expert's intermediate rows, ``moe/tp_experts.py``), that is a second
sharded dim, ``inner_dim`` with ``inner_rows``: a part is then a box, this rank's experts x the TP
rows it owns (``inner_runs``, as for any TP-sharded tensor).

It is read from the sharding metadata every parallel layer carries
(``nxd_hf.parallel_layers.sharding``). ``checkpoint/`` never imports the packages above it: what
it needs to know of a model it reads from the model's setup record, ``model.nxd``
(``nxd_hf.model_state``; any other module is a plain one): the HF model (config, renames, tied
keys), this rank's modules (``local_roots``: a pipelined model's local stages; otherwise the
object passed, whose wrappers ``NxDModel`` and ``peft.PeftModel`` list the inner model's
tensors) and the adapters the setup sequence added (``nxd.adapters``, the ``Adapters`` protocol
below, implemented by ``nxd_hf.lora.checkpoint``), which decide what ``save_checkpoint`` writes
of the model and ``load_checkpoint`` reads. A ``TensorSet`` stands for a model made of given
``LogicalTensor``s (ZeRO-1's ``save_sharded_state_dict`` saves its parameters through one).
"""

import dataclasses
import weakref
from typing import Protocol

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.model_state import state_of
from nxd_hf.parallel_layers.sharding import is_expert_parallel, is_sharded


@dataclasses.dataclass(kw_only=True)
class LogicalTensor:
    name: str  # on-disk (save_pretrained) name
    tensor: torch.Tensor  # the local parameter or buffer
    shape: tuple[int, ...]  # logical shape, on-disk orientation
    dim: int | None  # sharded dim in on-disk orientation; None: every rank holds the whole tensor
    rows: torch.Tensor | None  # logical row of each local row along dim, -1: padding
    transposed: bool  # the local tensor is the on-disk tensor transposed (HF Conv1D)
    runs: list[tuple[int, int, int]]  # (local start, local stop, logical start) rows this rank writes
    writes_whole: bool  # this rank writes the whole (replicated) tensor and scalar state
    model_name: str  # the parameter's name in the model
    section: str = "model"  # the index section: "model" (what consolidate writes) or "adapter"
    inner_dim: int | None = None  # a second sharded dim (TP rows of experts split along dim 0 over EP)
    inner_rows: torch.Tensor | None = None  # logical row of each local row along inner_dim, -1: padding
    inner_runs: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # inner rows this rank writes
    # a weight tied across pipeline stages, held here as a later stage's copy (``count_in_grad_norm``
    # False on the parameter): its first holder writes and gathers it
    tied_copy: bool = False

    def to_disk(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (laid out as ``tensor``) in on-disk orientation."""
        return local.t() if self.transposed else local

    def from_disk(self, disk: torch.Tensor) -> torch.Tensor:
        return disk.t() if self.transposed else disk


@dataclasses.dataclass
class TensorSet:
    """Stands for a model in ``save_checkpoint``/``load_checkpoint``: exactly these tensors."""

    tensors: list[LogicalTensor]


class Adapters(Protocol):
    """``model.nxd.adapters``: what a checkpoint holds of a model with adapters."""

    def save_plan(self, nxd_config) -> dict:
        """What to save (JSON, kept in the index as "adapters"), from ``nxd_config`` (may be None)."""

    def logical_tensors(self, model, plan: dict | None, *, loading: bool) -> list[LogicalTensor]:
        """The tensors to write or read: ``section`` "model" for the base model under HF names,
        "adapter" for the adapters. ``plan``: the saved one when loading (None: saved without adapters)."""

    def write_files(self, model, directory: str, plan: dict) -> None:
        """Side files (collective; every rank calls it before the completion marker)."""


def local_roots(model: nn.Module) -> list[nn.Module]:
    """The modules holding this rank's parameters under their original names."""
    if isinstance(model, (list, tuple)):  # the roots themselves (pipeline stages being set up)
        return list(model)
    state = state_of(model)
    return list(state.local_modules) if state is not None and state.pipelined else [model]


def hf_model(model: nn.Module) -> nn.Module:
    """The (possibly meta) Hugging Face model behind a wrapper: config, renames, tied keys."""
    state = state_of(model)
    return state.hf_model if state is not None else model


def adapters_of(model: nn.Module | None) -> Adapters | None:
    """The adapters the setup sequence added to ``model`` (see the module docstring), or None."""
    state = state_of(model)
    return state.adapters if state is not None else None


def model_config(model: nn.Module):
    return getattr(hf_model(model), "config", None)  # None for a plain (non-HF) module


class DiskNames:
    """Model name -> on-disk name: transformers' renamings (as ``save_pretrained`` reverts
    them) applied to the name. Weight converters (fusions such as MoE experts) are not
    reverted: such tensors are stored under their in-memory name and layout."""

    _cache: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module | None):
        if model_config(model) is None:
            self._renamings = []
            return
        if model not in self._cache:  # building transformers' tables takes ~0.5 s
            self._cache[model] = _reverse_renamings(model)
        self._renamings = self._cache[model]

    def __call__(self, name: str) -> str:
        if not self._renamings:
            return name
        from transformers.core_model_loading import apply_renamings

        return apply_renamings(name, self._renamings)


def _reverse_renamings(model: nn.Module) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    try:
        conversions = get_model_conversion_mapping(model, add_legacy=False) or []
    except Exception:  # an architecture transformers has no mapping for
        return []
    conversions = [c for c in conversions if not isinstance(c, PrefixChange)][::-1]
    reversed_ = [c.reverse_transform() for c in conversions]
    return [r for r in reversed_ if isinstance(r, WeightRenaming)]


def named_local_tensors(model: nn.Module, *, buffers: bool = True):
    """(model name, tensor) for every local parameter (each once) and persistent buffer."""
    seen = set()
    for root in local_roots(model):
        for name, param in root.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param
        if not buffers:
            continue
        for module_name, module in root.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                    continue
                seen.add(id(buffer))
                yield (f"{module_name}.{name}" if module_name else name), buffer


def logical_tensors(model: nn.Module, *, named=None) -> list[LogicalTensor]:
    """This rank's ``LogicalTensor``s, in the same order on every rank of a pipeline stage.
    Collective over the TP group (the owners of replicated rows are agreed on). ``named``:
    (name, tensor) pairs to describe instead of ``named_local_tensors(model)``."""
    if isinstance(model, TensorSet) and named is None:
        return list(model.tensors)
    disk_name = DiskNames(hf_model(model))
    tp_rank, dp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_size()
    if not parallel_state.model_parallel_is_initialized():  # plain replicas (e.g. DDP): all are DP ranks
        dp_rank, dp_size = backend.rank(), backend.world_size()
    edp_rank, edp_size = parallel_state.get_expert_data_parallel_rank(), parallel_state.get_expert_data_parallel_size()
    out = []
    for i, (name, tensor) in enumerate(named_local_tensors(model) if named is None else named):
        if is_expert_parallel(tensor):
            writes_here = i % edp_size == edp_rank and getattr(tensor, "count_in_grad_norm", True)
            out.append(describe_experts(disk_name(name), name, tensor, writes_here))
            continue
        writes_here = i % dp_size == dp_rank and getattr(tensor, "count_in_grad_norm", True)
        out.append(describe(disk_name(name), name, tensor, tp_rank, writes_here))
    return out


def describe_experts(name: str, model_name: str, tensor: torch.Tensor, writes_here: bool) -> LogicalTensor:
    """An expert-parallel tensor's ``LogicalTensor``: sharded along the expert dim 0, and along its
    TP dim too when TP shards it (module docstring; collective over TP then). ``writes_here``: this
    expert-data replica's turn; within it each TP rank writes the rows it owns."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if type(tensor).__name__ == "DTensor":  # sharded over the expert-data ranks by FSDP2 (ZeRO-2/3)
        from nxd_hf.checkpoint.dp_shard import describe_dp_experts

        return LogicalTensor(**describe_dp_experts(name, model_name, tensor, tp_rank, _owned_runs))
    rows = tensor.expert_shard_index
    shape = [tensor.expert_logical_size, *tensor.shape[1:]]
    assert rows.tolist() == list(range(int(rows[0]), int(rows[0]) + len(rows))), "experts are held in one block"
    inner = {}
    writes_rows = writes_here and tp_rank == 0  # TP-replicated (a bias added once): TP rank 0 writes it
    if is_sharded(tensor):
        assert tensor.partition_dim != 0 and not getattr(tensor, "hf_transposed", False), "TP shards the expert rows"
        shape[tensor.partition_dim] = tensor.logical_size
        inner_runs = _owned_runs(tensor.shard_index, tp_rank)  # collective over TP: every rank joins
        inner = dict(inner_dim=tensor.partition_dim, inner_rows=tensor.shard_index,
                     inner_runs=inner_runs if writes_here else [])
        writes_rows = writes_here and bool(inner_runs)
    runs = [(0, len(rows), int(rows[0]))] if writes_rows else []
    return LogicalTensor(name=name, tensor=tensor, shape=tuple(shape), dim=0, rows=rows, transposed=False, runs=runs,
                         writes_whole=writes_here and tp_rank == 0 and parallel_state.get_expert_parallel_rank() == 0,
                         model_name=model_name, **inner)


def describe(name: str, model_name: str, tensor: torch.Tensor, tp_rank: int, writes_here: bool) -> LogicalTensor:
    """``tensor``'s ``LogicalTensor`` under the on-disk ``name`` (collective over TP when it is sharded)."""
    if type(tensor).__name__ == "DTensor":  # sharded over DP by FSDP2 (ZeRO-2/3): every DP rank writes its rows
        from nxd_hf.checkpoint.dp_shard import describe_dp_shard

        fields = describe_dp_shard(name, model_name, tensor, tp_rank, _owned_runs)
        if not getattr(tensor, "count_in_grad_norm", True):  # the fields' tensor is the local shard, without the mark
            fields.update(runs=[], writes_whole=False, inner_runs=[], tied_copy=True)
        return LogicalTensor(**fields)
    transposed = bool(getattr(tensor, "hf_transposed", False))
    shape = list(tensor.shape)
    writes_whole = writes_here and tp_rank == 0
    if not is_sharded(tensor):
        shape = shape[::-1] if transposed else shape
        return LogicalTensor(name=name, tensor=tensor, shape=tuple(shape), dim=None, rows=None, transposed=transposed,
                             runs=[], writes_whole=writes_whole, model_name=model_name)
    dim = tensor.partition_dim
    rows = tensor.shard_index
    shape[dim] = tensor.logical_size
    if transposed:
        shape, dim = shape[::-1], 1 - dim
    runs = _owned_runs(rows, tp_rank)  # collective over TP: every rank joins
    return LogicalTensor(name=name, tensor=tensor, shape=tuple(shape), dim=dim, rows=rows, transposed=transposed,
                         runs=runs if writes_here else [], writes_whole=writes_whole, model_name=model_name)


def _owned_runs(rows: torch.Tensor, tp_rank: int) -> list[tuple[int, int, int]]:
    """Runs (local start, local stop, logical start) of the local rows whose logical row this
    rank holds first in TP-rank order: each logical row has exactly one owner."""
    group = parallel_state.get_tensor_model_parallel_group()
    gathered = backend.all_gather(rows.to(backend.collective_device(group)), 0, group).cpu()  # [tp * local]
    local = len(rows)
    positions = torch.arange(len(gathered))
    real = gathered >= 0
    first = torch.full((int(gathered.max()) + 1 if bool(real.any()) else 0,), len(gathered), dtype=torch.long)
    first.scatter_reduce_(0, gathered[real], positions[real], reduce="amin")
    mine = positions[tp_rank * local : (tp_rank + 1) * local]
    owned = ((rows >= 0) & (first[rows.clamp(min=0)] == mine)).nonzero().flatten()
    if len(owned) == 0:
        return []
    logical = rows[owned]
    breaks = ((owned[1:] != owned[:-1] + 1) | (logical[1:] != logical[:-1] + 1)).nonzero().flatten() + 1
    starts, stops = [0, *breaks.tolist()], [*breaks.tolist(), len(owned)]
    return [(int(owned[a]), int(owned[b - 1]) + 1, int(logical[a])) for a, b in zip(starts, stops)]
