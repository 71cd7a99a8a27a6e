"""The replicated parameters a tensor-parallel region leaves in place.

A replicated parameter inside a ``ParallelRegion`` (an MLP) that belongs to no swapped layer
sits between the column- and row-parallel layers when it is an activation's (apertus's xIELU
``alpha_p``/``alpha_n``): each rank sees its shard of the hidden units, so its gradient is
partial and is summed over TP (``mark_partial_grad_over_tp``). Any other such parameter is
refused: where it sits cannot be told from the plan.
"""

from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import is_sharded, mark_partial_grad_over_tp


def _is_activation(module_name: str, module: nn.Module) -> bool:
    leaf = module_name.rpartition(".")[2]
    return "act" in leaf.lower() or type(module).__module__ == "transformers.activations"


def mark_region_parameters(model: nn.Module, region_names: list[str], swapped: set[int]) -> None:
    """Mark (or refuse) the replicated parameters of each MLP region (see module doc)."""
    if parallel_state.get_tensor_model_parallel_size() == 1:
        return  # every rank sees full activations (DeepSeek-V3's whole experts beside its shared MLP)
    for region_name in region_names:
        region = model.get_submodule(region_name)
        for sub_name, sub in region.named_modules():
            for p_name, param in sub.named_parameters(recurse=False):
                if id(param) in swapped or is_sharded(param):
                    continue
                full_name = ".".join(n for n in (region_name, sub_name, p_name) if n)
                if not _is_activation(sub_name, sub):
                    raise ValueError(
                        f"{full_name!r} is a replicated parameter inside the tensor-parallel region {region_name!r}; "
                        "nxd_hf cannot tell whether it sees sharded or full activations. Leave the region's "
                        "layers out of the plan, or register a hand-written patch saying how it is reduced"
                    )
                mark_partial_grad_over_tp(param)  # partial over the hidden shards: summed over TP
