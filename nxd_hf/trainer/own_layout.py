"""The tensor-parallel layout of a plain PyTorch module in the config API, derived as
``nxd_hf.nnscaler`` derives it (``nxd_hf.fx_tp``): the module's forward is traced with torch.fx
on ``dummy_forward_args`` (one small batch, by argument name); ``nn.Linear`` layers whose
sharded output reaches another ``nn.Linear`` over the sharded dim become column -> row pairs
(MLPs; attention split by heads), ``nn.Embedding`` is split by vocabulary, and every other
layer stays replicated: the layout is exact, so the model computes what it computes in one
process. The module then runs its traced graph, whose reshapes take the local sizes.
With pipeline parallelism (``shard_plain_layers``) the layout is derived for each transformer
layer alone, traced on the inputs it gets in one forward of ``dummy_forward_args``: each layer
runs its own traced graph, and the pipeline cuts the module between the layers as usual; the
layers outside them (embedding, LM head) stay replicated."""

import functools
import inspect
import warnings

import torch
from torch import nn

from nxd_hf.fx_tp import derive
from nxd_hf.fx_tp.apply import apply_layouts, bind_graph_call

_MISSING = object()


def shard_plain_module(model: nn.Module, dummy_forward_args: dict | None, tp: int) -> dict[str, str]:
    """Shard ``model`` in place over ``tp`` ranks; returns its layout (module name -> "column",
    "row" or "vocab"). Warns naming the linear and embedding layers that stay replicated."""
    _check_dummy_forward_args(model, dummy_forward_args, tp)
    return _shard_traced(model, dummy_forward_args, tp)


def shard_plain_layers(model: nn.Module, dummy_forward_args: dict | None, tp: int, layer_types) -> dict[str, str]:
    """Shard each of ``model``'s transformer layers (``layer_types``: classes or class names) in
    place over ``tp`` ranks, as ``shard_plain_module`` shards a module, on the arguments it gets
    when ``model`` runs ``dummy_forward_args``; returns the layout by the model's module names."""
    _check_dummy_forward_args(model, dummy_forward_args, tp)
    names = {t if isinstance(t, str) else t.__name__ for t in (layer_types if isinstance(layer_types, (list, tuple))
                                                               else [layer_types])}
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ in names}
    captured = {}

    def capture(name):
        def hook(layer, args, kwargs):
            if name not in captured:  # its first call (a layer called twice is traced on the first)
                bound = inspect.signature(layer.forward).bind(*args, **kwargs).arguments
                captured[name] = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in bound.items()}
        return hook

    hooks = [layer.register_forward_pre_hook(capture(n), with_kwargs=True) for n, layer in layers.items()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # draws nothing of the user's generators
            model(**dummy_forward_args)
    finally:
        for hook in hooks:
            hook.remove()
    layouts = {}
    for name, layer in layers.items():
        if name not in captured:
            raise ValueError(f"{type(model).__name__}'s layer {name} did not run on dummy_forward_args: give dummy "
                             "inputs on which the forward calls every transformer layer")
        layouts.update({f"{name}.{n}": lay for n, lay in _shard_traced(layer, captured[name], tp).items()})
    outside = sorted(n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
                     and not any(n.startswith(f"{layer}.") for layer in layers))
    if outside:
        warnings.warn(f"tensor_parallel_size={tp} with pipeline parallelism: {type(model).__name__}'s layouts are "
                      f"derived inside its transformer layers; {outside} outside them stay replicated on every rank "
                      "(same result, no memory saved)", stacklevel=4)
    return layouts


def _check_dummy_forward_args(model: nn.Module, dummy_forward_args, tp: int) -> None:
    name = type(model).__name__
    if dummy_forward_args is None:
        raise ValueError(
            f"tensor_parallel_size={tp} for {name}, a plain PyTorch module: nxd_hf derives its tensor-parallel layout "
            "by tracing its forward on one small batch; pass it as neuronx_distributed_config(dummy_forward_args="
            "{'input_ids': ..., ...}) (the forward's arguments by name), build the model from nxd_hf's parallel "
            "layers, or use tensor_parallel_size=1")
    if not isinstance(dummy_forward_args, dict):
        raise ValueError(f"dummy_forward_args must be a dict of {name}.forward's arguments by name, got "
                         f"{type(dummy_forward_args).__name__}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{name} is on the meta device (meta_device_init=True): a plain module at "
                         f"tensor_parallel_size={tp} is traced on dummy_forward_args with its weights; build it on "
                         "the CPU (meta_device_init=False), or build it from nxd_hf's parallel layers")


def _shard_traced(model: nn.Module, dummy_forward_args: dict, tp: int) -> dict[str, str]:
    traced = derive.trace(model, dummy_forward_args)
    layouts = derive.derive_layouts(traced, tp)
    _warn_replicated(model, traced, layouts, tp)
    apply_layouts(model, traced, layouts, tp)
    for key, value in {**derive.graph_constants(traced.graphs[True], model),
                       **derive.graph_constants(traced.graphs[False], model)}.items():
        model.__dict__[key] = value  # tensors the graphs read (fx's constants), not the model's state
    model.forward = _graph_forward(model, traced)
    return layouts


def _warn_replicated(model: nn.Module, traced: derive.TracedGraph, layouts: dict[str, str], tp: int) -> None:
    kept = sorted(n for n, m in traced.modules.items() if isinstance(m, (nn.Linear, nn.Embedding)) and n not in layouts)
    if kept:
        warnings.warn(f"tensor_parallel_size={tp}: {type(model).__name__}'s layers {kept} have no exact split over "
                      "tensor-parallel ranks (their sharded output would not reach a row-parallel layer, or a size "
                      "does not divide); they stay replicated on every rank (same result, no memory saved)",
                      stacklevel=5)


def _graph_forward(model: nn.Module, traced: derive.TracedGraph):
    """``model.forward`` running the traced graph of its mode, with the original signature. The
    graph took the default of every argument missing from ``dummy_forward_args``: another value
    is refused rather than ignored."""
    run = bind_graph_call(model, traced.graphs, traced.input_names)
    signature = inspect.signature(model.forward)
    frozen = {n: p.default for n, p in signature.parameters.items() if n not in traced.input_names}

    @functools.wraps(type(model).forward)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        for arg, default in frozen.items():
            if bound.get(arg, default) is not default:
                raise ValueError(f"{type(model).__name__}.forward got {arg}, which was not in dummy_forward_args: the "
                                 f"tensor-parallel graph was traced with {arg}={default!r}; add {arg} to "
                                 "dummy_forward_args")
        return run(model, *args, **kwargs)

    forward.__signature__ = signature
    return forward
