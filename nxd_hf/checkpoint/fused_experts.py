"""Fused experts tensors read from the per-expert names ``save_pretrained`` writes.

transformers keeps a MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
``[E, 2I, H]``) but stores them per expert (``mlp.experts.0.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.0.w1.weight``); its loader merges them with a ``WeightConverter``
(``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=d)`` joins gate and up). This
module reads the same converter backwards for one fused parameter and fetches only this rank's
rows of each expert's tensors: a TP shard of the intermediate dim (rows of gate, rows of up),
and only the local experts when ``param.expert_shard_index`` says so (expert parallelism).
"""

import dataclasses
import re

import torch
from torch import nn

from nxd_hf.checkpoint.logical import DiskNames
from nxd_hf.parallel_layers.sharding import is_sharded


@dataclasses.dataclass(kw_only=True)
class ExpertSources:
    """Where one fused parameter lives on disk."""

    keys: list[list[str]]
    """keys[k][e]: the stored tensor of concatenated part k (gate, up) of expert e."""
    concat_dim: int | None
    """The fused dim the parts are concatenated along (None: one part)."""


def _converters(hf_model: nn.Module):
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return []
    found = []
    for conversion in extract_weight_conversions_for_model(hf_model) or []:
        if not isinstance(conversion, WeightConverter):
            continue
        ops = conversion.operations
        if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
            continue
        if len(ops) == 1:
            found.append((conversion, None))
        elif len(ops) == 2 and isinstance(ops[1], Concatenate):
            found.append((conversion, ops[1].dim))
    return found


def find_expert_sources(hf_model: nn.Module, name: str, num_experts: int, present, disk_name) -> ExpertSources | None:
    """The per-expert keys (among ``present``) holding fused parameter ``name`` of ``hf_model``,
    or None. ``disk_name`` maps a model name to its on-disk name (transformers' renamings)."""
    for conversion, concat_dim in _converters(hf_model):
        for target in conversion.target_patterns:
            target = target.lstrip("^").rstrip("$")
            if not name.endswith(target.lstrip(".")) or re.search(r"[\\*(\[]", target):
                continue
            stem = name[: len(name) - len(target.lstrip("."))]
            keys = [[_present(stem, source, e, present, disk_name) for e in range(num_experts)]
                    for source in conversion.source_patterns]
            if all(k is not None for part in keys for k in part):
                return ExpertSources(keys=keys, concat_dim=concat_dim)
    return None


def _present(stem: str, source: str, expert: int, present, disk_name) -> str | None:
    key = stem + source.lstrip("^").lstrip(".").replace("*", str(expert)).replace("\\", "")
    for candidate in (key, disk_name(key)):
        if candidate in present:
            return candidate
        if "." in candidate and candidate.split(".", 1)[1] in present:  # stored without the base prefix
            return candidate.split(".", 1)[1]
    return None


def fused_parameters(hf_model, named, keys: dict, checkpoint) -> dict:
    """{name: ExpertSources} for fused experts parameters stored per expert (see ``fused_experts``)."""
    fused, disk_name = {}, None
    for name, param in named:
        if keys[name] is None and param.dim() == 3 and ".experts." in f".{name}":
            disk_name = disk_name or DiskNames(hf_model)
            sources = find_expert_sources(hf_model, name, getattr(param, "expert_logical_size", param.shape[0]), checkpoint,
                                          disk_name)
            if sources is not None:
                fused[name] = sources
    return fused


def read_fused(checkpoint, sources: ExpertSources, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the fused ``param`` from its per-expert tensors."""
    experts = getattr(param, "expert_shard_index", None)
    experts = range(len(sources.keys[0])) if experts is None else [int(e) for e in experts]
    dim = param.partition_dim if is_sharded(param) else None
    assert dim != 0 or not is_sharded(param), "experts are split over EP (expert_shard_index), not along TP dim 0"
    sizes = [checkpoint.shape(part[0])[sources.concat_dim - 1] for part in sources.keys] if sources.concat_dim else []
    stacked = []
    for e in experts:
        pieces = []
        offset = 0
        for k, part in enumerate(sources.keys):
            key = part[e]
            if dim is None:
                pieces.append(checkpoint.read(key))
            elif sources.concat_dim == dim:
                rows = param.shard_index
                mine = rows[(rows >= offset) & (rows < offset + sizes[k])] - offset
                if len(mine):
                    pieces.append(checkpoint.read_rows(key, dim - 1, mine))
                offset += sizes[k]
            else:
                pieces.append(checkpoint.read_rows(key, dim - 1, param.shard_index))
        stacked.append(torch.cat(pieces, dim=sources.concat_dim - 1) if len(pieces) > 1 else pieces[0])
    return torch.stack(stacked)


def read_stored_fused(checkpoint, key: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert-parallel ``param`` stored fused under ``key`` (gpt-oss, an
    older consolidation), only its TP rows of each when TP shards them too."""
    experts = param.expert_shard_index
    if not is_sharded(param):
        return checkpoint.read_rows(key, 0, experts)
    return checkpoint.read_rows(key, param.partition_dim, param.shard_index,
                                within=(0, int(experts[0]), int(experts[-1]) + 1))


def per_expert_converters(model_type: str | None) -> list:
    """(converter, concat dim) of ``model_type``'s experts merges, as transformers registers them."""
    if not model_type:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return []
    found = []
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        ops = getattr(conversion, "operations", None) or []
        if not isinstance(conversion, WeightConverter) or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
            continue
        if len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate)):
            found.append((conversion, ops[1].dim if len(ops) == 2 else None))
    return found


def split_fused(name: str, tensor: torch.Tensor, converters: list) -> list[tuple[str, torch.Tensor]]:
    """``name``'s whole fused experts tensor as transformers' ``save_pretrained`` stores it: one
    tensor per expert (and per concatenated part), under the converter's source names; other
    tensors unchanged."""
    for conversion, concat_dim in converters:
        for target in conversion.target_patterns:
            target = target.lstrip("^").rstrip("$").lstrip(".")
            if tensor.dim() != 3 or not name.endswith(target) or re.search(r"[\\*(\[]", target):
                continue
            stem = name[: len(name) - len(target)]
            sources = conversion.source_patterns
            parts = tensor.chunk(len(sources), dim=concat_dim) if concat_dim is not None else (tensor,)
            return [(stem + source.lstrip("^").lstrip(".").replace("*", str(e)), part[e].contiguous())
                    for source, part in zip(sources, parts) for e in range(tensor.shape[0])]
    return [(name, tensor)]
