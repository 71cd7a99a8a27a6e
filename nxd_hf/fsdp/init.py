"""``param_init_fn`` straight into the data-parallel shards (``parallelize(model_on_meta,
param_init_fn=fn, data_parallel_sharding=...)``): the parameters stay on the meta device through
the setup steps, ``fully_shard`` shards them there and each rank allocates its local shards
(``nxd_hf.fsdp.load``); then every module, in the order ``materialize`` visits them, gets each of
its own parameters back as a plain tensor of the TP-local shape for ``fn(module)``, and this
rank keeps its DP rows of the result. So a rank holds its shards plus one TP-local parameter at a
time (``InitReport.largest_bytes``), never a TP shard of the model, and the values are those of
``fn`` without FSDP, bit for bit: the same modules and parameters in the same order draw from the
same generator. As without FSDP, the data-parallel replicas are checked to have initialized
alike (a fingerprint of each TP-local value, compared over the DP group: an unseeded init raises).

A parameter shared by several modules (an embedding tied to the LM head) is initialized by each
of them in turn, as without FSDP (the last one's values stay): from the second on, ``fn`` sees
its current value, gathered over the DP ranks. ``fn(module)`` must initialize the module's own
parameters only (NxD's contract): the parameters of its submodules are DP shards at that point.
"""

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nxd_hf.checkpoint.dp_shard import dp_rows, local_of
from nxd_hf.model_setup.replicas import fingerprint
from nxd_hf.parallel_layers.sharding import is_expert_parallel


@dataclasses.dataclass
class InitReport:
    """What initializing into the DP shards held (``model.nxd.init_report``)."""

    largest_bytes: int = 0
    """Bytes of the largest plain tensor built (one TP-local parameter, or a gathered tied one):
    what initializing holds beyond the model's own shards at any time."""
    parameters_initialized: int = 0
    """Parameters handed to ``param_init_fn`` (a tied one once per module holding it)."""
    fingerprints: list = dataclasses.field(default_factory=list, repr=False)
    """(name, ``replicas.fingerprint`` of the TP-local value, expert-parallel) of each, for the
    check that the data-parallel replicas initialized alike (``replicas.check_fingerprints_equal``)."""


@torch.no_grad()
def init_dp_shards(roots: list[nn.Module], param_init_fn, *, modules: set[int] | None = None) -> InitReport:
    """Run ``param_init_fn(module)`` on every module of ``roots`` (each once, ``root.modules()``
    order) with its own DP-sharded parameters as plain TP-local tensors, and copy this rank's
    rows of each into its allocated local shard (module docstring). A failure in ``param_init_fn``
    is raised after the loop: every rank still joins the gathers of tied parameters, so a rank
    failing alone raises instead of leaving the others waiting in a gather. ``modules``: the ids of
    the modules to initialize (default: all; LoRA: not the adapters and their wrappers, made at setup)."""
    report, seen_modules, seen_params = InitReport(), set(), set()
    error = None
    for root in roots:
        for module_name, module in root.named_modules():
            if id(module) in seen_modules or (modules is not None and id(module) not in modules):
                continue
            seen_modules.add(id(module))
            sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
            plain = {name: _plain(p, gather=id(p) in seen_params) for name, p in sharded.items()}
            seen_params.update(id(p) for p in sharded.values())
            report.largest_bytes = max([report.largest_bytes, *(t.numel() * t.element_size() for t in plain.values())])
            if error is None:
                module._parameters.update(plain)
                try:
                    param_init_fn(module)
                    report.parameters_initialized += len(plain)
                    for name, param in sharded.items():
                        value = module._parameters[name]
                        _keep_rows(param, value)
                        if getattr(param, "count_in_grad_norm", True):  # else tied to an earlier stage's: overwritten
                            report.fingerprints.append((f"{module_name}.{name}".lstrip("."), fingerprint(value),
                                                        is_expert_parallel(param)))
                except Exception as caught:  # noqa: BLE001 - raised after the loop, on every rank alike
                    error = caught
                finally:
                    module._parameters.update(sharded)  # FSDP2's own parameters back
    if error is not None:
        raise error
    return report


def _plain(param: DTensor, *, gather: bool) -> nn.Parameter:
    """A plain parameter of ``param``'s TP-local shape with its sharding metadata, uninitialized
    (as ``materialize`` allocates it) or, for a parameter a module before initialized, its
    current value gathered over the DP ranks."""
    value = param.full_tensor() if gather else torch.empty(param.shape, dtype=param.dtype,
                                                           device=local_of(param).device)
    plain = nn.Parameter(value, requires_grad=param.requires_grad)
    plain.__dict__.update(vars(param))  # nxd_hf's metadata (tensor_model_parallel, partition_dim, ...)
    return plain


def _keep_rows(param: DTensor, value: torch.Tensor) -> None:
    """Copy this rank's DP rows of the TP-local ``value`` into ``param``'s local shard."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"param_init_fn changed a parameter's shape from {tuple(param.shape)} to "
                         f"{tuple(value.shape)}: initialize it in place (nn.init functions, copy_)")
    start, count, _ = dp_rows(param)
    local_of(param).copy_(value[start:start + count])
