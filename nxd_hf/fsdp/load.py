"""Weights loaded straight into the data-parallel shards (``nxd_hf.from_pretrained`` with
``data_parallel_sharding``), or initialized there (``param_init_fn`` on a meta-device model,
``nxd_hf.fsdp.init``): the parameters stay on the meta device through the setup steps,
``fully_shard`` shards them there, and only then does each rank allocate its DP shards
(``allocate_dp_shards``) and read its rows of the files into them
(``nxd_hf.checkpoint.hf_dp_shards``). No rank ever holds a whole TP shard of the model, nor, while
loading, of any one parameter: at rest it holds 1/dp of it, and while loading one parameter's DP
rows more (while initializing, one TP-local parameter more).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxd_hf.fsdp.init import InitReport, init_dp_shards
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.model_setup.replicas import check_fingerprints_equal


def fill_dp_shards(roots: list[nn.Module], device, *, load_dp_shards=None, param_init_fn=None,
                   sync_ties=None) -> InitReport | None:
    """Allocate the DP shards of every FSDP root in ``roots`` (the model, or a pipeline's local
    stages) on ``device`` and fill them: ``load_dp_shards(roots)`` reads them, or else
    ``param_init_fn`` initializes them (returns its ``InitReport``). ``sync_ties()`` then makes
    the weights tied across pipeline stages equal (the first holder's values, as without FSDP)."""
    assert (load_dp_shards is None) != (param_init_fn is None), "one way to fill the shards"
    report = None
    with fail_together("nxd_hf.parallelize (weights into the data-parallel shards)"):
        for root in roots:
            allocate_dp_shards(root, device)
        if load_dp_shards is not None:
            load_dp_shards(roots)
        else:
            report = init_dp_shards(roots, param_init_fn)
    if report is not None:  # as step 7 checks materialized weights (nxd_hf.model_setup.replicas)
        check_fingerprints_equal(report.fingerprints)
    if sync_ties is not None:
        sync_ties()
    return report


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
