"""The torch.fx tracer of ``nxd_hf.nnscaler`` and of the config API's plain modules at tp > 1:
tracing with the user's dummy inputs, as nnScaler does.

Every proxy carries the value its operation takes on ``dummy_forward_args`` (computed as the
trace goes, without gradients). Shapes stay symbolic where torch.fx can record them
(``x.shape[1]``, ``x.size(-1)``, arithmetic on them, ``view(b, s, h, d)``), so the graph runs on
other shapes too; where Python itself needs a number (``if s > 1``, ``range(s)``, ``int(s)``,
unpacking ``b, s, d = x.shape``) the dummy inputs' value is used, as in nnScaler's concrete
tracing. Tensor factories (``torch.ones(s, s)``, ``zeros``, ``full``, ``arange``, ``empty``, ...)
whose sizes come from shapes become graph nodes. Control flow on tensor *values* (``if
x.sum() > 0``, ``.item()``) is refused: a graph taking the dummy inputs' branch would be silently
wrong on others. A failure names the user's line and the construct.
"""

import contextlib
import os
import traceback

import torch
from torch import fx, nn
from torch.fx.proxy import TraceError

from nxd_hf.pipeline.trace import untraced_module_calls

_MISSING = object()
FACTORIES = ("ones", "zeros", "full", "empty", "arange", "rand", "randn", "randint", "eye", "linspace", "tensor",
             "tril_indices", "triu_indices", "as_tensor")
DATA_METHODS = ("item", "tolist", "nonzero", "numpy")
"""Methods whose value is the tensor's data (or a data-dependent shape): never concretized."""
_NXD_HF = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # frames of nxd_hf are not the user's
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def user_line(tb=None) -> str:
    """``file:line: code`` of the innermost frame outside torch and nxd_hf (the user's code)."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH, _NXD_HF)) and "/torch/fx/" not in path and frame.filename != "<eval_with_key>":
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown line>"


class ConcreteProxy(fx.Proxy):
    """A proxy whose dummy-input value is known (``node.meta["val"]``); see the module docstring."""

    def _concrete(self, construct: str):
        val = self.node.meta.get("val", _MISSING)
        what = f"{self.node.op} {getattr(self.node.target, '__name__', self.node.target)}"
        if self.node.meta.get("nxd_data") or isinstance(val, torch.Tensor):
            raise TraceError(f"{construct} of a value computed from tensor data ({what}) at {user_line()}: "
                             "data-dependent control flow cannot be traced into one graph; compute it with tensor "
                             "ops (torch.where, masking) or outside forward")
        if val is _MISSING:
            error = self.node.meta.get("nxd_error")
            raise TraceError(f"{construct} of {what} at {user_line()}: its value on the dummy inputs is unknown"
                             + (f" ({error})" if error else ""))
        return val

    def __bool__(self) -> bool:
        return bool(self._concrete("bool()/if/while"))

    def __index__(self) -> int:
        return int(self._concrete("an integer use"))

    def __int__(self) -> int:
        return int(self._concrete("int()"))

    def __float__(self) -> float:
        return float(self._concrete("float()"))

    def __len__(self) -> int:
        val = self.node.meta.get("val", _MISSING)
        if isinstance(val, torch.Tensor):
            return len(val)  # the size of dim 0: a shape, not data
        return len(self._concrete("len()"))

    def __iter__(self):
        val = self.node.meta.get("val", _MISSING)
        if isinstance(val, (tuple, list)):  # sizes (b, s, d = x.shape), a module's tuple output
            return iter([self[i] for i in range(len(val))])
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return iter([self[i] for i in range(len(val))])
        return super().__iter__()


class ConcreteTracer(fx.Tracer):
    """torch.fx with dummy-input values (see the module docstring). ``example_inputs``: the
    placeholders' values by name; torch.nn's own modules and nxd_hf's parallel layers are leaves."""

    def __init__(self, example_inputs: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        # cloned: an in-place op in forward must not change the caller's dummy inputs
        self.example_inputs = {k: _clone(v) for k, v in (example_inputs or {}).items()}

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return super().is_leaf_module(m, qualified_name) or type(m).__module__.startswith("nxd_hf.parallel_layers")

    def proxy(self, node: fx.Node) -> ConcreteProxy:
        return ConcreteProxy(node, self)

    def trace(self, root, concrete_args=None):
        with _traced_factories(self), torch.no_grad():
            graph = super().trace(root, concrete_args)
        for node in graph.nodes:  # the graph does not keep the dummy values alive
            for key in ("val", "nxd_error", "nxd_data"):
                node.meta.pop(key, None)
        return graph

    def create_proxy(self, kind, target, args, kwargs, *rest, **named):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **named)
        node = proxy.node
        if kind == "placeholder":
            name = target.lstrip("*")
            node.meta["val"] = self.example_inputs.get(name, _MISSING)
        elif kind in ("call_function", "call_method", "call_module", "get_attr"):
            inputs = node.all_input_nodes
            node.meta["nxd_data"] = (kind == "call_method" and target in DATA_METHODS) or any(
                n.meta.get("nxd_data") for n in inputs)
            try:
                node.meta["val"] = self._value(kind, target, args, kwargs)
            except Exception as exc:  # the graph's own run (ShapeProp) reports it where it matters
                node.meta["nxd_error"] = f"{type(exc).__name__}: {exc}"
        return proxy

    def _value(self, kind, target, args, kwargs):
        def unwrap(a):
            if isinstance(a, fx.Proxy):
                val = a.node.meta.get("val", _MISSING)
                if val is _MISSING:
                    raise ValueError(f"no value for {a.node.name}")
                return val
            return a

        args, kwargs = fx.node.map_aggregate(args, unwrap), fx.node.map_aggregate(kwargs, unwrap)
        if kind == "get_attr":
            owner, _, name = target.rpartition(".")
            with untraced_module_calls():  # fx's patched getattr would answer a parameter with a new proxy
                return getattr(self.root.get_submodule(owner) if owner else self.root, name)
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        module = self.root.get_submodule(target)
        if any(type(m).__module__.startswith("nxd_hf.parallel_layers") for m in module.modules()):
            # its collectives would run inside the trace (a rank failing there hangs the others)
            raise ValueError(f"{target} holds nxd_hf parallel layers: not run while tracing")
        with untraced_module_calls():
            return module(*args, **kwargs)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _traced_factories(tracer: fx.Tracer):
    """``torch.ones(s, s)`` etc. with a size (or any argument) from the trace become graph nodes."""
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def wrap(fn):
        def factory(*args, **kwargs):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, fx.Proxy))
            if any(isinstance(x, fx.Proxy) for x in leaves):
                return tracer.create_proxy("call_function", fn, args, kwargs)
            return fn(*args, **kwargs)
        return factory

    for name, fn in originals.items():
        setattr(torch, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


__all__ = ["ConcreteProxy", "ConcreteTracer", "user_line"]
