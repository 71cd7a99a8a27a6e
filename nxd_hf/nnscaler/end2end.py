"""End2end modules on the pipeline runtime (``nxd_hf.pipeline.NxDPPModel``).

``NxDPPModel`` takes named tensors and splits them into micro-batches along dim 0; an end2end
module takes one sample (any pytree of tensors). ``alias`` gives the module the pipeline
traces: it rebuilds the sample from its flattened leaves (``in_0``, ``in_1``, ...), calls the
user's module, and multiplies the loss by a per-micro-batch weight (``loss_weight``: 0 for a
dummy batch, else the number of micro-batches, which the pipeline divides by again), after the
user's ``scale_fn`` (``LossScale``, a leaf module set per step).
"""

import inspect

import torch
import torch.utils._pytree as pytree
from torch import nn

from nxd_hf.fx_tp import derive
from nxd_hf.fx_tp.tracer import ConcreteTracer


class LossScale(nn.Module):
    """``scale_fn`` of the running ``train_step`` (identity outside one)."""

    def __init__(self):
        super().__init__()
        self.fn = None

    def forward(self, loss):
        return self.fn(loss) if self.fn is not None else loss


def alias(module: nn.Module, spec: pytree.TreeSpec, num_leaves: int) -> nn.Module:
    """The module the pipeline traces: an instance of a subclass of the user's class sharing the
    user module's ``__dict__`` (same children, parameters, names; ``super()`` in the user's
    forward still works), whose ``forward`` takes the flattened sample (see the module docstring)."""
    names = [f"in_{i}" for i in range(num_leaves)] + ["loss_weight"]
    user_forward = type(module).forward
    namespace = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return _run(self, [{', '.join(names)}])\n",
         {"_run": lambda self, flat: _run(self, user_forward, flat)}, namespace)  # one named placeholder each
    cls = type(type(module).__name__, (type(module),), {"forward": namespace["forward"]})
    wrapper = cls.__new__(cls)
    wrapper.__dict__ = module.__dict__
    module._nxd_loss_scale = LossScale()
    module.__dict__.update(_nxd_spec=spec, _nxd_input_names=names)
    return wrapper


def _run(self, user_forward, flat):
    *leaves, weight = flat
    out = user_forward(self, pytree.tree_unflatten(leaves, self._nxd_spec))
    if isinstance(out, (tuple, list)):
        return (self._nxd_loss_scale(out[0]) * weight[0], *out[1:])
    return self._nxd_loss_scale(out) * weight[0]


def dummy_input_tracer(wrapper: nn.Module, sample_leaves: list) -> type[ConcreteTracer]:
    """The pipeline's tracer class: ``ConcreteTracer`` with the dummy sample (one micro-batch) as
    the example inputs of ``alias``'s placeholders (the loss weight: one per micro-batch)."""
    first = next((x for x in sample_leaves if isinstance(x, torch.Tensor)), None)
    weight = torch.ones(1, device=first.device if first is not None else None)
    examples = dict(zip(wrapper._nxd_input_names, [*sample_leaves, weight]))

    def __init__(self, **kwargs):
        ConcreteTracer.__init__(self, examples, **kwargs)
    return type("DummyInputTracer", (ConcreteTracer,), {"__init__": __init__})


def flatten_samples(samples: list, spec: pytree.TreeSpec | None = None):
    """(leaves concatenated along dim 0 over the samples, the samples' common structure)."""
    flats = []
    for sample in samples:
        leaves, s = pytree.tree_flatten(sample)
        spec = spec or s
        if s != spec:
            raise ValueError(f"every sample of a pipelined train_step/infer_step must have the structure {spec}, got {s}")
        if not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in leaves):
            raise ValueError("a pipelined end2end module takes samples whose leaves are tensors with a batch dim 0")
        flats.append(leaves)
    return [torch.cat(column) for column in zip(*flats)], spec


def block_types(module: nn.Module) -> tuple[type, ...]:
    """The repeated blocks pipeline stages are cut between: the children type of the longest
    ``nn.ModuleList`` whose children share one type."""
    best = None
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise ValueError(f"{type(module).__name__} has no nn.ModuleList of repeated blocks to cut into pipeline "
                         "stages: hold the repeated layers in an nn.ModuleList")
    return (type(best[0]),)


def rewrite_blocks(module: nn.Module, example_sample, layer_types: tuple[type, ...], tp: int,
                   layouts: dict[str, str]) -> tuple[type, ...]:
    """Under tp > 1 in a pipeline, each block runs as its own traced graph whose reshapes take
    local sizes; the blocks are swapped in place (same parameter names). Returns the new block
    classes (each ``fx.GraphModule`` has its own) and adds the blocks' layouts to ``layouts``."""
    blocks = [(name, m) for name, m in module.named_modules() if isinstance(m, layer_types)]
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, kwargs, name=name: inputs.setdefault(name, (args, kwargs)),
                                         with_kwargs=True) for name, m in blocks]
    try:
        with torch.no_grad():
            module(example_sample)
    finally:
        for h in hooks:
            h.remove()
    new_types = []
    for name, block in blocks:
        args, kwargs = inputs[name]
        params = list(inspect.signature(block.forward).parameters)
        traced = derive.trace(block, {**dict(zip(params, args)), **kwargs})
        for local, lay in derive.derive_layouts(traced, tp).items():
            if lay in ("column", "row"):
                layouts[f"{name}.{local}"] = lay
        derive.rewrite_shapes(traced, tp)
        gm = traced.graphs[True]
        _same_order(gm, block)
        module.set_submodule(name, gm)
        new_types.append(type(gm))
    return tuple(new_types)


def _same_order(new: nn.Module, old: nn.Module) -> None:
    """Order ``new``'s (a traced copy of ``old``) children, parameters and buffers as ``old``'s:
    fx orders them by first use, while optimizer states are merged in the original ``parameters()`` order."""
    for attr in ("_modules", "_parameters", "_buffers"):
        mine, theirs = getattr(new, attr), getattr(old, attr)
        order = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
        items = [(k, mine[k]) for k in order]
        mine.clear()
        mine.update(items)
    for name, child in new._modules.items():
        if name in old._modules and child is not old._modules[name]:
            _same_order(child, old._modules[name])


__all__ = ["alias", "LossScale", "block_types", "flatten_samples", "rewrite_blocks"]
