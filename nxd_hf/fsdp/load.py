"""Weights loaded straight into the data-parallel shards (``nxd_hf.from_pretrained`` with
``data_parallel_sharding``): the parameters stay on the meta device through the setup steps,
``fully_shard`` shards them there, and only then does each rank allocate its DP shards
(``allocate_dp_shards``) and read its rows of the files into them
(``nxd_hf.checkpoint.hf_dp_shards``). No rank ever holds a whole TP shard of the model, nor of
any one parameter: at rest it holds 1/dp of it, and while loading one parameter's DP rows more.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def allocate_dp_shards(model: nn.Module, device) -> None:
    """Give every meta DTensor parameter of ``model`` (sharded by ``fully_shard``) real memory for
    its local shard on ``device`` (uninitialized: the caller fills it). Buffers, already real, are
    kept. nxd_hf's sharding metadata is kept on the parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    bad = [name for name, p in params.items() if p.is_meta and not isinstance(p, DTensor)]
    assert not bad, f"meta parameters outside FSDP2's shards: {bad[:3]}"
    metadata = {name: dict(vars(p)) for name, p in params.items()}
    # FSDP2's ``_apply`` re-points its padded shard storage at the new local tensors
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for name, param in model.named_parameters(remove_duplicate=False):
        for key, value in metadata[name].items():
            setattr(param, key, value)
