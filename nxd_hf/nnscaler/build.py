"""Build a ``ParallelModule`` on nxd_hf's engine: the setup sequence of ``nxd_hf.parallelize``.

0. ``parallel_state`` with the plan's tp x pp (ranks beyond are the units, data parallel), after
   one all-gather checking every rank builds the same plan, config and module class;
1-3. (inside ``fail_together``) trace the module, apply the plan's layout: ``nn.Linear`` layers
   become Column/RowParallelLinear and embeddings ParallelEmbedding through ``nxd_hf.tp.apply``
   (the ``ModelPatch`` of exact module names), reshapes of split values take local sizes;
   a Hugging Face model goes through ``nxd_hf.parallelize`` itself (its registered plan);
4. pp > 1: ``NxDPPModel`` over the end2end wrapper (``nxd_hf.nnscaler.end2end``);
5-10. ``nxd_hf.model_setup.set_up_local_modules``: gradient reduction over the units, device.
"""

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.fx_tp import derive
from nxd_hf.fx_tp.apply import apply_layouts, bind_graph_call, patch_of
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.guards.input_check import InputCheck, resolve_mode
from nxd_hf.model_setup import LocalSetup, set_up_whole_module
from nxd_hf.nnscaler import end2end, unused
from nxd_hf.tp.apply import apply_tensor_parallel


def build(pm, module: nn.Module, spec, *, init_params: bool = True) -> None:
    config, plan = spec.compute_config, spec.plan
    backend.init_process_group_from_env()
    everyone_initialized = _agree(module, spec, init_params)
    if backend.world_size() != config.runtime_ngpus:
        raise ValueError(f"ComputeConfig.runtime_ngpus={config.runtime_ngpus} but this run has {backend.world_size()} "
                         "ranks: set runtime_ngpus to the world size")
    _init_parallel_state(plan.tp_size, plan.pp_size)
    if spec.is_hf:
        return _build_hf(pm, module, spec)
    # replicas built without weights (init_params=False on some rank) get them after setup (broadcast_weights)
    setup = LocalSetup(bucket_size_mb=config.reducer_bucket_cap_mb or 25, check_replicas=everyone_initialized)
    if plan.pp_size > 1:
        return _build_pipeline(pm, module, spec, setup)
    with fail_together("nxd_hf.nnscaler.parallelize"):
        traced = derive.trace(module, spec.dummy_forward_args)
        unused.drop_unused_parameters(module, list(traced.graphs.values()))  # as nnScaler's ParallelModule
        patch = None
        if plan.tp_size > 1:
            columns = {n for n, lay in plan.layouts.items() if lay == "column"}
            derived = derive.derive_layouts(traced, plan.tp_size, columns=columns)
            assert {k: v for k, v in derived.items() if v != "vocab"} == {
                k: v for k, v in plan.layouts.items() if v != "vocab"}, "the plan was derived from another module"
            patch = apply_layouts(module, traced, plan.layouts, plan.tp_size)
    state = set_up_whole_module(module, setup, tp_size=plan.tp_size, patch=patch, input_check=_input_check())
    policy = state.grad_reduction
    pm._adopt(module)
    pm.nxd = state
    for name, value in {**derive.graph_constants(traced.graphs[True], module),
                        **derive.graph_constants(traced.graphs[False], module)}.items():
        pm.__dict__[name] = value
    if plan.tp_size > 1:
        pm._run = bind_graph_call(module, traced.graphs, traced.input_names)
    else:  # replicated: the module's own forward (self.training as in plain torch)
        pm._run = lambda _pm, *args, **kwargs: type(module).forward(_in_mode(module, _pm), *args, **kwargs)
    if not spec.compute_config.inference_only:
        policy.install_hooks(pm)


def _build_hf(pm, model: nn.Module, spec) -> None:
    from nxd_hf.parallelize import parallelize as nxd_parallelize

    plan, config = spec.plan, spec.compute_config
    kwargs = {}
    if plan.pp_size > 1:
        kwargs = dict(num_microbatches=config.pas_config.get("pipeline_nmicros", plan.pp_size),
                      schedule=config.pas_config.get("pipeline_scheduler", "1f1b"))
    out = nxd_parallelize(model, tensor_parallel_size=plan.tp_size, pipeline_parallel_size=plan.pp_size,
                          bucket_size_mb=config.reducer_bucket_cap_mb or 25, **kwargs)
    if plan.pp_size > 1:
        pm._pipeline = out
        pm.nxd = out.nxd
        return
    pm._adopt(model)
    pm.nxd = model.nxd
    pm._run = lambda _pm, *args, **kwargs: _in_mode(model, _pm)(*args, **kwargs)  # its hooks reduce the gradients


def _build_pipeline(pm, module: nn.Module, spec, setup: LocalSetup) -> None:
    from nxd_hf.pipeline.model import NxDPPModel

    plan, config = spec.plan, spec.compute_config
    first = next(iter(spec.dummy_forward_args))
    sample = spec.dummy_forward_args[first]
    with fail_together("nxd_hf.nnscaler.parallelize (pipeline)"):
        layer_types = end2end.block_types(module)
        layouts = {k: v for k, v in plan.layouts.items() if v == "vocab"}
        if plan.tp_size > 1:
            layer_types = end2end.rewrite_blocks(module, sample, layer_types, plan.tp_size, layouts)
            apply_tensor_parallel(module, patch_of(layouts), None, sequence_parallel=False)
        sample_leaves, tree = torch.utils._pytree.tree_flatten(sample)
        wrapper = end2end.alias(module, tree, len(sample_leaves))
        leaves = [end2end.LossScale, *{type(m) for m in module.modules()  # parallel layers run, not traced
                                       if type(m).__module__.startswith("nxd_hf.parallel_layers")}]
        tracer_cls = end2end.dummy_input_tracer(wrapper, sample_leaves)
    pipe = NxDPPModel(wrapper, transformer_layer_cls=layer_types,
                      num_microbatches=config.pas_config.get("pipeline_nmicros", plan.pp_size),
                      input_names=wrapper._nxd_input_names, tracer_cls=tracer_cls, leaf_module_cls=leaves,
                      return_mb_loss=True, schedule=config.pas_config.get("pipeline_scheduler", "1f1b"), setup=setup)
    pipe.nxd.patch = patch_of(plan.layouts) if plan.tp_size > 1 else None
    pipe.nxd.input_check = _input_check()
    pm._pipeline = pipe
    pm.nxd = pipe.nxd


def _input_check() -> InputCheck:
    """nxd_hf's first-step check that the ranks of a unit got the same input (no vocabulary)."""
    return InputCheck(vocab_size=None, mode=resolve_mode(True))


def _in_mode(module: nn.Module, pm) -> nn.Module:
    """``module`` with the ``ParallelModule``'s ``training`` flag (its children share it already)."""
    module.training = pm.training
    return module


def _init_parallel_state(tp: int, pp: int) -> None:
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size())
        if have == (tp, pp):
            return
        raise ValueError(f"parallel_state is initialized with tp={have[0]}, pp={have[1]} but the plan needs "
                         f"tp={tp}, pp={pp}: every parallel module of a run uses the same plan_ngpus layout")
    parallel_state.initialize_model_parallel(tp, pp)


def _agree(module: nn.Module, spec, init_params: bool) -> bool:
    """Every rank builds the same plan for the same module class (one all-gather); returns
    whether every rank starts from real weights."""
    mine = {"module": type(module).__qualname__, "plan": spec.plan.as_dict(),
            "config": repr(spec.compute_config.as_dict())}
    everyone = backend.all_gather_object({**mine, "init_params": init_params})
    differ = [key for key in mine if any(r[key] != mine[key] for r in everyone)]
    if differ:
        raise ValueError("nxd_hf.nnscaler.parallelize built different " + ", ".join(differ) + " on different ranks: "
                         + "; ".join(f"rank {i}: {r}" for i, r in enumerate(everyone))
                         + ". Call it with the same module, policy and ComputeConfig on every rank")
    return all(r["init_params"] for r in everyone)
