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

from nxd_hf.fsdp.init import init_dp_shards
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.model_setup.replicas import check_fingerprints_equal


def init_after_sharding(model: nn.Module, data_parallel_sharding, param_init_fn, *, load_weights,
                        adapters_on_meta: bool) -> bool:
    """Whether ``param_init_fn`` initializes FSDP2's DP shards (``nxd_hf.fsdp.init``) instead of the
    TP shard: a model wholly on the meta device under ZeRO-2/3. ``adapters_on_meta``: LoRA's
    adapters (added before sharding) can be made on the meta base and drawn again after the init
    (``nxd_hf.lora.meta_base``), or there are none. Otherwise, and for real or partly real weights,
    the TP shard is materialized as without FSDP."""
    return (data_parallel_sharding is not None and param_init_fn is not None and load_weights is None
            and adapters_on_meta and all(p.is_meta for p in model.parameters()))


def fill_dp_shards(model: nn.Module, roots: list[nn.Module], device, *, load_dp_shards=None, param_init_fn=None,
                   sync_ties=None, init_modules: set[int] | None = None) -> None:
    """Allocate the DP shards of every FSDP root in ``roots`` (the model, or a pipeline's local
    stages) on ``device`` and fill them: ``load_dp_shards(roots)`` reads them, or else
    ``param_init_fn`` initializes them (its ``InitReport`` becomes ``model.nxd.init_report``;
    the replicas are checked to have initialized alike, as step 7 checks materialized weights;
    ``init_modules``: as ``init_dp_shards``' ``modules``).
    ``sync_ties()`` then makes the weights tied across pipeline stages equal (the first holder's
    values, as without FSDP)."""
    report = None
    with fail_together("nxd_hf.parallelize (weights into the data-parallel shards)"):
        for root in roots:
            allocate_dp_shards(root, device)
        if load_dp_shards is not None:
            load_dp_shards(roots)
        else:
            report = init_dp_shards(roots, param_init_fn, modules=init_modules)
    if report is not None:
        check_fingerprints_equal(report.fingerprints)
        model.nxd.record_init_report(report)
    if sync_ties is not None:
        sync_ties()


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
