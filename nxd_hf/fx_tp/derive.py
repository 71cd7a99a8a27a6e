"""Trace any ``nn.Module`` with its dummy inputs and derive the exact tensor-parallel layout.

``trace`` gives a ``TracedGraph``: torch.fx graphs of the module's ``forward`` in training and
in eval mode (nnScaler's limited ``self.training`` support: each mode's branch is traced),
every node annotated with its shape (``node.meta["tensor_meta"]``) and, once a layout is
derived, with the dim its value is sharded along (``node.meta["nxd_sharded_dim"]``).

``derive_layouts`` picks the ``nn.Linear`` layers that can be column-parallel: a column
layer's output is sharded along its last dim, and ``nxd_hf.fx_tp.shard_rules`` follows that
sharding through the graph; the layout is kept only if every path ends in an ``nn.Linear`` over
the sharded dim (row-parallel), so Linear -> elementwise -> Linear chains become column -> row
pairs and attention blocks (q/k/v -> scaled_dot_product_attention or matmul-softmax-matmul ->
out) are split by heads. ``nn.Embedding`` is split by vocabulary. Everything else is replicated.
Reshapes inside a sharded region take local sizes (``rewrite_shapes``).
"""

import dataclasses
import inspect
import operator

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from nxd_hf.fx_tp import shard_rules
from nxd_hf.fx_tp.tracer import ConcreteTracer, user_line

LAYOUTS = ("column", "row", "vocab", "replicate")


@dataclasses.dataclass(kw_only=True, eq=False)
class TracedGraph:
    """What a custom ``pas_policy`` receives (with the ``ComputeConfig``)."""

    module: nn.Module = dataclasses.field(repr=False)
    """The user's module (not yet parallel)."""
    graphs: dict[bool, fx.GraphModule] = dataclasses.field(repr=False)
    """The traced forward by mode: ``graphs[True]`` training, ``graphs[False]`` eval."""
    input_names: list[str]
    """The forward's arguments, in order (the keys of ``dummy_forward_args``)."""
    modules: dict[str, nn.Module] = dataclasses.field(repr=False)
    """Every module the graphs call, by its name in the module."""
    derived: dict[str, str] = dataclasses.field(default_factory=dict)
    """nxd_hf's exact layout for ``tp_size``: module name -> "column" / "row" / "vocab" (others replicated)."""
    tp_size: int = 1

    def nodes(self, training: bool = True) -> list[fx.Node]:
        return list(self.graphs[training].graph.nodes)


def trace(module: nn.Module, dummy_forward_args: dict) -> TracedGraph:
    """Trace ``module.forward`` called with ``dummy_forward_args`` (by argument name)."""
    signature = inspect.signature(module.forward)
    names = list(signature.parameters)
    unknown = set(dummy_forward_args) - set(names)
    if unknown:
        raise ValueError(f"dummy_forward_args has {sorted(unknown)}, which are not arguments of "
                         f"{type(module).__name__}.forward{signature}")
    for name, p in signature.parameters.items():
        if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{type(module).__name__}.forward has a {p.kind.description} argument {name!r}: "
                             "it cannot be parallelized (nnScaler's rule); give it named arguments")
        if name not in dummy_forward_args and p.default is p.empty:
            raise ValueError(f"dummy_forward_args lacks {name!r}, an argument of {type(module).__name__}.forward "
                             "without a default: give a dummy value for every such argument")
    inputs = [n for n in names if n in dummy_forward_args]
    graphs, was_training = {}, module.training
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}  # BatchNorm's running stats...
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        for training in (True, False):
            module.train(training)
            with torch.random.fork_rng(devices=cuda):  # dropout on the dummy inputs draws nothing of the user's
                graphs[training] = _trace_mode(module, dummy_forward_args, inputs, {
                    n: signature.parameters[n].default for n in names if n not in dummy_forward_args})
    finally:
        module.train(was_training)
        with torch.no_grad():  # tracing runs forward on the dummy inputs: leave the module as it was
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    modules = dict(module.named_modules())
    called = {n.target: modules[n.target] for g in graphs.values() for n in g.graph.nodes if n.op == "call_module"}
    return TracedGraph(module=module, graphs=graphs, input_names=inputs, modules=called)


def _trace_mode(module: nn.Module, dummy_forward_args: dict, inputs: list[str], defaults: dict) -> fx.GraphModule:
    """One mode's graph, every node annotated with its shape (``tensor_meta``)."""
    tracer = ConcreteTracer({n: dummy_forward_args[n] for n in inputs})
    try:
        graph = tracer.trace(module, concrete_args=defaults or None)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        line = user_line(exc.__traceback__)
        where = "" if line in str(exc) else f" at {line}"
        raise ValueError(f"cannot trace {type(module).__name__} with torch.fx on dummy_forward_args{where} "
                         f"({type(exc).__name__}: {exc})") from exc
    gm = fx.GraphModule(module, graph, class_name=type(module).__name__ + "Traced")
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*[dummy_forward_args[n] for n in inputs])
    except RuntimeError as exc:
        raise ValueError(f"{type(module).__name__} fails on dummy_forward_args ({exc.__cause__ or exc}): give "
                         "dummy inputs the module runs on (dtype, device and shapes)") from exc
    return gm


def _shape(node):
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


@dataclasses.dataclass(kw_only=True)
class _Result:
    sharded: dict
    rows: set
    need: fx.Node | None = None
    fail: str | None = None


def _propagate(gm: fx.GraphModule, columns: set[fx.Node], modules: dict, tp: int) -> _Result:
    sharded, rows = {}, set()
    for node in gm.graph.nodes:
        if node in columns:
            sharded[node] = len(_shape(node)) - 1
            continue
        if not any(isinstance(a, fx.Node) and a in sharded for a in node.all_input_nodes):
            continue
        verdict = shard_rules.rule(node, sharded, _shape, modules, tp)
        if verdict[0] == "dim":
            sharded[node] = verdict[1]
        elif verdict[0] == "row":
            rows.add(node)
        elif verdict[0] == "need":
            return _Result(sharded=sharded, rows=rows, need=verdict[1])
        elif verdict[0] == "fail":
            return _Result(sharded=sharded, rows=rows, fail=f"{node.name}: {verdict[1]}")
    return _Result(sharded=sharded, rows=rows)


def _source_linear(node: fx.Node, modules: dict) -> fx.Node | None:
    """The ``nn.Linear`` call a value comes from through single-input ops (k and v of attention)."""
    while isinstance(node, fx.Node):
        if node.op == "call_module" and isinstance(modules.get(node.target), nn.Linear):
            return node
        if node.op not in ("call_method", "call_function") or not node.args:
            return None
        node = node.args[0]  # the tensor operand; the others are sizes or scalars
    return None


def _is_column_candidate(node: fx.Node, modules: dict, tp: int) -> bool:
    module = modules.get(node.target) if node.op == "call_module" else None
    return (isinstance(module, nn.Linear) and module.out_features % tp == 0 and len(node.args) == 1
            and _shape(node) is not None and type(module).forward is nn.Linear.forward)


def _called_differently(columns: set, rows: set, calls: dict, modules: dict, tp: int) -> str | None:
    """Why the layout is not exact for a module called more than once (None when it is)."""
    for node in columns:
        if not all(c in columns and _is_column_candidate(c, modules, tp) for c in calls[node.target]):
            return f"{node.target} is called more than once, not every call column-parallel"
    for node in rows:
        if not calls[node.target] <= rows:
            return f"{node.target} is called more than once, not every call row-parallel"
    return None


def shard_graph(gm: fx.GraphModule, modules: dict, tp: int, columns: set[str] | None = None):
    """(column node set, row node set, sharded dims) of the largest exact layout; with
    ``columns`` (module names) only those may be column-parallel (a user policy's choice)."""
    chosen, rows, excluded, result = set(), set(), set(), _Result(sharded={}, rows=set())
    calls = {}  # a module called twice has one layout: all its calls are column, or row, or neither
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, set()).add(node)
    for node in gm.graph.nodes:
        if node in chosen or node in rows or node in excluded or not _is_column_candidate(node, modules, tp):
            continue
        if columns is not None and node.target not in columns:
            continue
        if node.args[0] in result.sharded:
            continue
        group = set(calls[node.target])
        while True:
            attempt = _propagate(gm, chosen | group, modules, tp)
            if attempt.need is not None:
                source = _source_linear(attempt.need, modules)
                if (source is not None and source not in group and source not in chosen and source not in rows
                        and _is_column_candidate(source, modules, tp)
                        and (columns is None or source.target in columns)):
                    group |= calls[source.target]
                    continue
                attempt.fail = f"{attempt.need.name} would need to be sharded"
            elif attempt.fail is None:
                attempt.fail = _called_differently(chosen | group, attempt.rows, calls, modules, tp)
            break
        if attempt.fail is not None:
            excluded |= group
            continue
        chosen |= group
        result, rows = attempt, attempt.rows
    return chosen, rows, result.sharded


def _vocab_embeddings(traced: TracedGraph, tp: int) -> set[str]:
    counts = {}
    for _, p in traced.module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {name for name, m in traced.modules.items()
            if type(m) is nn.Embedding and m.max_norm is None and not m.sparse and counts[id(m.weight)] == 1
            and m.num_embeddings >= tp}


def derive_layouts(traced: TracedGraph, tp: int, columns: set[str] | None = None) -> dict[str, str]:
    """Module name -> layout for ``tp``, the same in both modes' graphs (annotates the nodes)."""
    layouts = {}
    if tp == 1:
        return layouts
    for training in (True, False):
        gm = traced.graphs[training]
        chosen, rows, sharded = shard_graph(gm, traced.modules, tp, columns if training else
                                            {k for k, v in layouts.items() if v == "column"})
        for node in gm.graph.nodes:
            node.meta["nxd_sharded_dim"] = sharded.get(node)
        mode = {n.target: "column" for n in chosen} | {n.target: "row" for n in rows}
        if training:
            layouts = mode
        elif mode != layouts:
            raise ValueError(f"{type(traced.module).__name__} shards differently in training and in eval mode "
                             f"({layouts} vs {mode}): use a pas_policy that names the layout of each module")
    layouts.update({name: "vocab" for name in _vocab_embeddings(traced, tp)})
    traced.derived, traced.tp_size = layouts, tp
    return layouts


def rewrite_shapes(traced: TracedGraph, tp: int) -> None:
    """Reshapes of sharded values take the local size of the sharded dim (a literal full size
    becomes full/tp; -1 and sizes read from tensors are already local)."""
    for gm in traced.graphs.values():
        for node in gm.graph.nodes:
            j = node.meta.get("nxd_sharded_dim")
            if j is None or not (node.op == "call_method" and node.target in ("view", "reshape")
                                 or node.target is torch.reshape):
                continue
            args = list(node.args)
            nested = len(args) == 2 and isinstance(args[1], (list, tuple))
            sizes = list(args[1] if nested else args[1:])
            if isinstance(sizes[j], int) and sizes[j] != -1:
                sizes[j] //= tp
            elif isinstance(sizes[j], fx.Node):  # a full size read from a replicated tensor
                with gm.graph.inserting_before(node):
                    sizes[j] = gm.graph.call_function(operator.floordiv, (sizes[j], tp))
            node.args = (args[0], type(args[1])(sizes)) if nested else (args[0], *sizes)
        gm.recompile()


def graph_constants(gm: fx.GraphModule, module: nn.Module) -> dict[str, torch.Tensor]:
    """Attributes the graph reads that are not parameters, buffers or modules (fx's tensor constants)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "." not in node.target and node.target not in module._parameters \
                and node.target not in module._buffers and node.target not in module._modules:
            out[node.target] = getattr(gm, node.target)
    return out


__all__ = ["LAYOUTS", "TracedGraph", "trace", "derive_layouts", "rewrite_shapes"]
