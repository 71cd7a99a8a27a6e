"""``nxd_hf.nnscaler.parallelize``: nnScaler's entry point on nxd_hf's engine (docs/nnscaler.md)."""

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from nxd_hf.model_state import state_of
from nxd_hf.fx_tp import derive
from nxd_hf.nnscaler import policy
from nxd_hf.nnscaler.config import ComputeConfig
from nxd_hf.nnscaler.module import ParallelModule, Spec
from nxd_hf.nnscaler.reuse import prepare_gen_savedir


def parallelize(
    module_or_module_class: nn.Module | type[nn.Module],
    dummy_forward_args: dict,
    pas_policy: str | Callable,
    compute_config: ComputeConfig,
    *,
    gen_savedir: str | Path = "./.nnscaler",
    reuse="match",
    instance_name: str | None = None,
    load_module: bool = True,
    module_dtype: torch.dtype | None = None,
    module_fn: Callable[[], nn.Module] | None = None,
    init_module_params: bool = True,
    broadcast_strategy="none",
):
    """A module object gives a ``ParallelModule`` object (the module's own weights, sharded); a
    module class gives a ``ParallelModule`` class whose constructor ``(init_params=True)`` builds
    the module (``module_fn()`` or ``cls()``) and starts from the weights traced here. The plan
    (``pas_policy``: "dp", "data", "tp", "pp", "hybrid", or ``fn(TracedGraph, ComputeConfig) ->
    Plan``) is saved as JSON in ``gen_savedir/<instance_name>`` (``reuse``, ``broadcast_strategy``:
    ``nxd_hf.nnscaler.reuse``). ``load_module=False`` only plans (and saves) and returns None."""
    if not isinstance(compute_config, ComputeConfig):
        raise ValueError(f"compute_config must be an nxd_hf.nnscaler.ComputeConfig, got {type(compute_config).__name__}")
    if not isinstance(dummy_forward_args, dict):
        raise ValueError("dummy_forward_args must be a dict: forward's argument name -> dummy value")
    is_class = isinstance(module_or_module_class, type)
    if is_class and not issubclass(module_or_module_class, nn.Module) or not is_class and not isinstance(
            module_or_module_class, nn.Module):
        raise ValueError(f"parallelize takes an nn.Module or an nn.Module class, got {module_or_module_class!r}")
    if module_fn is not None and not is_class:
        warnings.warn("module_fn is ignored: it builds the module only when a module class is given", stacklevel=2)
    if is_class and init_module_params is not True:
        warnings.warn("init_module_params is ignored for a module class: pass init_params to the returned class's "
                      "constructor", stacklevel=2)
    if not is_class and state_of(module_or_module_class) is not None:
        raise ValueError("this module is already parallel (it has model.nxd): parallelize the original module once")
    if is_class:
        factory = module_fn or module_or_module_class
        new_module = (lambda: factory().to(module_dtype)) if module_dtype is not None else factory
        module = new_module()
    else:
        new_module = None
        module = module_or_module_class
        if module_dtype is not None:
            module.to(module_dtype)
    _refuse_nested(module)
    is_hf = hasattr(module, "config") and hasattr(module, "base_model_prefix")
    graph = None if is_hf else derive.trace(module, dummy_forward_args)
    plan = policy.resolve(pas_policy, compute_config, graph, module=module, dummy_forward_args=dummy_forward_args)
    instance_name = instance_name or "_"
    save = functools.partial(_save_plan, module, plan, compute_config, gen_savedir, instance_name, reuse,
                             broadcast_strategy, load_module)
    if not load_module:
        save()
        return None
    spec = Spec(plan=plan, compute_config=compute_config, dummy_forward_args=dummy_forward_args,
                new_module=new_module, instance_name=instance_name, is_hf=is_hf,
                initial_state={k: v.detach().clone() for k, v in module.state_dict().items()} if is_class else None)

    def __init__(self, *args, **kwargs):
        ParallelModule.__init__(self, *args, **kwargs)
        save()  # after building it: a build refused on the way (sizes, ranks disagreeing) leaves no plan behind

    cls = type(f"{type(module).__name__}Parallel", (ParallelModule,),
               {"_spec": spec, "__module__": __name__, "__init__": __init__})
    return cls if is_class else cls(init_module_params, _module=module)


class NestedParallelModuleError(ValueError, RuntimeError):
    """A ValueError, as nxd_hf's user errors are, that is also the RuntimeError nnScaler raises for
    it, so code written against nnScaler catches it too."""


def _refuse_nested(module: nn.Module) -> None:
    """nnScaler refuses a module holding a parallel module: that part is planned already, and
    planning it again would shard its shards."""
    for name, sub in module.named_modules():
        if sub is not module and state_of(sub) is not None:
            raise NestedParallelModuleError(
                f"Parallel modules can not be nested: {type(module).__name__}.{name} is parallel already. "
                "Parallelize the outer module's other parts on their own, or build it from the original "
                "(non-parallel) submodule")


def _save_plan(module, plan, config, gen_savedir, instance_name, reuse, broadcast_strategy, load_module) -> None:
    """``gen_savedir`` holds what nxd_hf generates: the plan (``nxd_hf.nnscaler.reuse`` checks it
    against a saved one under ``reuse="match"`` and copies it between nodes per ``broadcast_strategy``)."""
    record = {"module": type(module).__qualname__, "plan": plan.as_dict(), "compute_config": {
        k: v for k, v in config.as_dict().items()}}
    prepare_gen_savedir(gen_savedir=gen_savedir, instance_name=instance_name, reuse=reuse,
                        broadcast_strategy=broadcast_strategy, plan=record, module=module, load_module=load_module)
