"""Build a ``ParallelModule`` on nxd_hf's engine: the setup sequence of ``nxd_hf.parallelize``.

0. ``parallel_state`` with the plan's tp x pp (ranks beyond are the units, data parallel) by the
   setup sequence's step 0 (``nxd_hf.setup_steps``), after one all-gather checking every rank
   builds the same plan, config and module class (``nxd_hf.guards.same_everywhere``);
1-3. (inside ``fail_together``) trace the module, apply the plan's layout: ``nn.Linear`` layers
   become Column/RowParallelLinear and embeddings ParallelEmbedding through ``nxd_hf.tp.apply``
   (the ``ModelPatch`` of exact module names), reshapes of split values take local sizes;
   a Hugging Face model goes through ``nxd_hf.parallelize`` itself (its registered plan);
4. pp > 1: ``NxDPPModel`` over the end2end wrapper (``nxd_hf.nnscaler.end2end``);
5-10. ``nxd_hf.model_setup.finish_parallel_model``: gradient reduction over the units, device,
   the module's ``NxDModelState`` (the ``ParallelModule`` reads it through its ``nxd`` property).
"""

import dataclasses

import torch
from torch import nn

from nxd_hf import backend
from nxd_hf.fx_tp import derive
from nxd_hf.fx_tp.apply import apply_layouts, bind_graph_call, patch_of
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.guards.input_check import InputCheck, resolve_mode
from nxd_hf.guards.same_everywhere import check_same_on_every_rank
from nxd_hf.model_setup import LocalSetup, SetupRecord, finish_parallel_model
from nxd_hf.nnscaler import end2end, unused
from nxd_hf.setup_steps import init_parallel_state, requested_sizes
from nxd_hf.tp.apply import apply_tensor_parallel


def build(pm, module: nn.Module, spec, *, init_params: bool = True) -> None:
    config, plan = spec.compute_config, spec.plan
    everyone_initialized = _agree(module, spec, init_params)
    if backend.world_size() != config.runtime_ngpus:
        raise ValueError(f"ComputeConfig.runtime_ngpus={config.runtime_ngpus} but this run has {backend.world_size()} "
                         "ranks: set runtime_ngpus to the world size")
    sizes = requested_sizes(tensor_parallel_size=plan.tp_size, pipeline_parallel_size=plan.pp_size,
                            expert_parallel_size=1, timeout=None)
    init_parallel_state(sizes, None, asked="the plan needs",
                        hint="every parallel module of a run uses the same plan_ngpus layout")
    if spec.is_hf:
        return _build_hf(pm, module, spec)
    # replicas built without weights (init_params=False on some rank) get them after setup (broadcast_weights)
    setup = LocalSetup(bucket_size_mb=config.reducer_bucket_cap_mb or 25, check_replicas=everyone_initialized,
                       record=SetupRecord(input_check=_input_check()))
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
    setup = dataclasses.replace(setup, record=dataclasses.replace(setup.record, patch=patch))
    hooks_on = None if spec.compute_config.inference_only else pm  # the ParallelModule runs the forward
    finish_parallel_model(module, [module], setup, carriers=[module], hooks_on=hooks_on)
    pm._adopt(module)
    for name, value in {**derive.graph_constants(traced.graphs[True], module),
                        **derive.graph_constants(traced.graphs[False], module)}.items():
        pm.__dict__[name] = value
    if plan.tp_size > 1:
        pm._run = bind_graph_call(module, traced.graphs, traced.input_names)
    else:  # replicated: the module's own forward (self.training as in plain torch)
        pm._run = lambda _pm, *args, **kwargs: type(module).forward(_in_mode(module, _pm), *args, **kwargs)


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
        return
    pm._adopt(model)
    pm._run = lambda _pm, *args, **kwargs: _in_mode(model, _pm)(*args, **kwargs)  # its hooks reduce the gradients


def _build_pipeline(pm, module: nn.Module, spec, setup: LocalSetup) -> None:
    from nxd_hf.pipeline.model import NxDPPModel

    plan, config = spec.plan, spec.compute_config
    first = next(iter(spec.dummy_forward_args))
    sample = spec.dummy_forward_args[first]
    patch = patch_of(plan.layouts) if plan.tp_size > 1 else None
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
                      return_mb_loss=True, schedule=config.pas_config.get("pipeline_scheduler", "1f1b"),
                      setup=dataclasses.replace(setup, record=dataclasses.replace(setup.record, patch=patch)))
    pm._pipeline = pipe


def _input_check() -> InputCheck:
    """nxd_hf's first-step check that the ranks of a unit got the same input (no vocabulary)."""
    return InputCheck(vocab_size=None, mode=resolve_mode(True))


def _in_mode(module: nn.Module, pm) -> nn.Module:
    """``module`` with the ``ParallelModule``'s ``training`` flag (its children share it already)."""
    module.training = pm.training
    return module


def _agree(module: nn.Module, spec, init_params: bool) -> bool:
    """Every rank builds the same plan for the same module class (one all-gather); returns
    whether every rank starts from real weights."""
    mine = {"module": type(module).__qualname__, "plan": spec.plan.as_dict(),
            "config": repr(spec.compute_config.as_dict())}
    everyone = check_same_on_every_rank("nxd_hf.nnscaler.parallelize", mine, gathered_too={"init_params": init_params},
                                        fix="Call it with the same module, policy and ComputeConfig on every rank")
    return all(r["init_params"] for r in everyone)
