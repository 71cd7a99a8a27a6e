"""Parameters the traced graphs do not use leave the ``ParallelModule``, as in nnScaler.

nnScaler's ``ParallelModule`` holds the parameters of its traced graph only: a parameter that
neither the training nor the eval graph reads is absent from its ``parameters()``, its
``state_dict()`` and so from ``merge_state_dicts``' result, and gets no optimizer state. The
original module's parameter order is kept (``ORIGINAL_PARAM_NAMES``) so the merged optimizer
state still indexes the original module's ``parameters()``.

A dropped parameter stays readable as a plain tensor attribute (detached, not registered), so a
forward that reads it outside the graph (its ``.shape``, say) still runs.
"""

import torch
from torch import fx, nn

ORIGINAL_PARAM_NAMES = "_nxd_hf_original_param_names"
"""Attribute of the module: its parameter names in ``parameters()`` order before the drop."""


def used_tensors(graphs: list[fx.GraphModule], module: nn.Module) -> set[int]:
    """ids of the parameters and buffers of ``module`` that the graphs read."""
    used = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_module":
                used.update(id(t) for t in module.get_submodule(node.target).parameters())
                used.update(id(t) for t in module.get_submodule(node.target).buffers())
            elif node.op == "get_attr":
                owner, _, name = node.target.rpartition(".")
                try:
                    value = getattr(module.get_submodule(owner), name)
                except AttributeError:  # an fx constant of the graph module, not of the module
                    continue
                if isinstance(value, torch.Tensor):
                    used.add(id(value))
    return used


def drop_unused_parameters(module: nn.Module, graphs: list[fx.GraphModule]) -> list[str]:
    """Unregister the parameters of ``module`` that no graph reads (every name of a tied tensor
    is kept when one name is used); record the original parameter names. Returns the dropped names."""
    module.__dict__[ORIGINAL_PARAM_NAMES] = [name for name, _ in module.named_parameters()]
    used = used_tensors(graphs, module)
    dropped = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for name, p in list(owner._parameters.items()):
            if p is not None and id(p) not in used:
                del owner._parameters[name]
                owner.__dict__[name] = p.detach()
                dropped.append(f"{owner_name}.{name}" if owner_name else name)
    return dropped


def original_param_names(module: nn.Module) -> list[str] | None:
    """The names ``drop_unused_parameters`` recorded (None when it did not run on ``module``)."""
    return module.__dict__.get(ORIGINAL_PARAM_NAMES)
