"""A derived layout applied to the module it was derived from: ``nn.Linear`` layers become
Column/RowParallelLinear and embeddings ParallelEmbedding through ``nxd_hf.tp.apply`` (a
``ModelPatch`` naming each module exactly), reshapes of split values take local sizes, and the
module then runs its traced graph (``bind_graph_call``), whose reshapes are the rewritten ones."""

import inspect

from torch import nn

from nxd_hf.fx_tp import derive
from nxd_hf.tp import plan as tp_plan
from nxd_hf.tp.apply import apply_tensor_parallel

STYLES = {"column": tp_plan.Column, "row": tp_plan.Row, "vocab": tp_plan.Embedding}


def patch_of(layouts: dict[str, str]) -> tp_plan.ModelPatch:
    """The ``ModelPatch`` naming each module exactly (``nxd_hf.tp.apply`` applies it)."""
    return tp_plan.ModelPatch(model_type="nnscaler", plan={name: STYLES[lay]() for name, lay in layouts.items()
                                                           if lay in STYLES},
                              base_model_prefix="", lm_head=None, sequence_parallel=False)


def apply_layouts(module: nn.Module, traced: derive.TracedGraph, layouts: dict[str, str], tp: int) -> tp_plan.ModelPatch:
    """Shard ``module``'s layers as ``layouts`` says and rewrite ``traced``'s reshapes for ``tp``;
    returns the patch applied."""
    patch = patch_of(layouts)
    apply_tensor_parallel(module, patch, None, sequence_parallel=False)
    derive.rewrite_shapes(traced, tp)
    return patch


def bind_graph_call(module: nn.Module, graphs: dict, input_names: list[str]):
    """``run(pm, *args, **kwargs)``: the traced graph of ``pm.training``'s mode, bound to ``pm``."""
    signature = inspect.signature(module.forward)

    def run(pm, *args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        graph = graphs[pm.training]
        return type(graph).forward(pm, *[bound.arguments[n] for n in input_names])

    return run


__all__ = ["STYLES", "patch_of", "apply_layouts", "bind_graph_call"]
