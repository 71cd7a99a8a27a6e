"""An FX tracer for Hugging Face models in transformers 5.x.

Plain ``torch.fx`` fails on HF's decorated ``forward`` methods (``*args/**kwargs`` wrappers
that capture outputs and merge config defaults), and HF's own ``HFTracer`` is gone. This tracer
records only the model's spine — the modules on the path from the root to the transformer
layers — and treats everything else as a leaf:

- each module's undecorated ``forward`` (``inspect.unwrap``) is traced, so wrappers never see
  proxies;
- transformer layers, parallel layers, embeddings, norms, rotary embeddings — every module that
  does not contain a transformer layer — are leaves (called, not traced);
- HF mask builders (``create_causal_mask`` and friends) become leaf function calls that return
  a materialized mask (``allow_is_causal_skip=False``), so a stage boundary never carries a
  value that is a tensor on one batch and None on the next, unless every stage recomputes the
  mask itself (``nxd_hf.pipeline.recompute``);
- proxies carry a fake-tensor value, so the metadata HF code branches on (``ndim``,
  ``dtype``, ``dim()``) is concrete, while shapes and devices stay symbolic (a traced model
  runs any sequence length, on any device);
- the model is traced without labels: the pipeline's last stage applies the model's own
  ``loss_function`` to the logits (see ``nxd_hf.pipeline.model``).
"""

import contextlib
import inspect

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from nxd_hf.pipeline.fake_experts import fake_safe_experts
from nxd_hf.pipeline.fake_memo import LayerFakeRuns
from nxd_hf.pipeline.mask_builders import no_patch, patched_mask_builders


class MetaProxy(fx.Proxy):
    """A proxy whose rank and dtype are known (from its fake value), so Python control flow on
    them traces; anything else stays symbolic. It has its tensor's attributes and no others:
    duck typing (transformers' ``is_tracing`` calls ``x.jax()`` where jax is importable) must
    not leave a node no tensor can run, so the graph never depends on what else is installed."""

    def __getattr__(self, name: str):
        value = self.__dict__.get("node") and self.node.meta.get("val")
        if isinstance(value, torch.Tensor) and not hasattr(value, name):
            raise AttributeError(f"'{type(value).__name__}' object has no attribute '{name}' (traced value "
                                 f"{self.node.name})")
        return super().__getattr__(name)

    def _value(self):
        value = self.node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise fx.proxy.TraceError(f"no tensor metadata for {self.node.name}: cannot use it in control flow")
        return value

    @property
    def ndim(self) -> int:
        return self._value().ndim

    @property
    def dtype(self) -> torch.dtype:
        return self._value().dtype

    def dim(self) -> int:
        return self._value().dim()


FAKE_FAILED = "fake_failed"
"""``node.meta`` key set on a traced node whose fake value could not be computed (its "val" is then None)."""


_FAILED = object()


@contextlib.contextmanager
def untraced_module_calls():
    """Run modules normally inside a trace (fx patches ``nn.Module.__call__``/``__getattr__``
    while tracing)."""
    from torch.fx import _symbolic_trace as st

    patched_call, patched_getattr = nn.Module.__call__, nn.Module.__getattr__
    nn.Module.__call__, nn.Module.__getattr__ = st._orig_module_call, st._orig_module_getattr
    try:
        yield
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = patched_call, patched_getattr


class HFSpineTracer(fx.Tracer):
    """Traces only modules that contain a transformer layer (see the module docstring)."""

    def __init__(self, layer_types: tuple[type, ...], leaf_types: tuple[type, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.layer_types, self.leaf_types = layer_types, leaf_types
        self._spine: set[int] = set()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.example_inputs: dict[str, torch.Tensor] = {}
        self.extra_modules: dict[str, nn.Module] = {}
        self.layer_runs = LayerFakeRuns(layer_types)
        # > 0 while an operation runs on fake values: fx's patched Module.__call__/__getattr__ then
        # pass through (swapping them back on nn.Module costs ~1 ms a node: it resets the type
        # caches of every module class)
        self._fake_depth = 0

    def proxy(self, node: fx.Node) -> MetaProxy:
        return MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **named):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **named)
        if kind == "placeholder":
            proxy.node.meta["val"] = self.fake_mode.from_tensor(self.example_inputs[target])
        elif kind in ("call_function", "call_method", "call_module"):
            value = self._fake_value(kind, target, args, kwargs)
            if value is _FAILED:
                proxy.node.meta[FAKE_FAILED] = True
            proxy.node.meta["val"] = None if value is _FAILED else value
        return proxy

    def _fake_value(self, kind: str, target, args, kwargs):
        """The fake result of one traced operation, or ``_FAILED`` when it cannot be computed."""
        def unwrap(a):
            return a.node.meta.get("val") if isinstance(a, fx.Proxy) else a

        args, kwargs = fx.node.map_aggregate(args, unwrap), fx.node.map_aggregate(kwargs, unwrap)
        self._fake_depth += 1
        try:
            with self.fake_mode, fake_safe_experts():
                if kind == "call_function":
                    return target(*args, **kwargs)
                if kind == "call_method":
                    return getattr(args[0], target)(*args[1:], **kwargs)
                module = _ExtraModules(self.root, self.extra_modules).get_submodule(target)
                return self.layer_runs.call(module, args, kwargs, lambda: module(*args, **kwargs))
        except Exception:
            return _FAILED
        finally:
            self._fake_depth -= 1

    def getattr(self, attr: str, attr_val, parameter_proxy_cache: dict):
        if self._fake_depth:  # a module running on fake values reads its own tensors
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def mark_spine(self, root: nn.Module) -> None:
        """Remember every module that has a transformer layer below it."""
        def visit(module: nn.Module) -> bool:
            holds = isinstance(module, self.layer_types)
            for child in module.children():
                holds = visit(child) or holds
            if holds and not isinstance(module, self.layer_types):
                self._spine.add(id(module))
            return holds

        visit(root)

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if isinstance(module, self.leaf_types):
            return True
        return id(module) not in self._spine

    def call_module(self, module, forward, args, kwargs):
        if self._fake_depth:
            return forward(*args, **kwargs)
        if not self.is_leaf_module(module, self.path_of_module(module)):
            forward = inspect.unwrap(type(module).forward).__get__(module)  # skip HF's decorators
        return super().call_module(module, forward, args, kwargs)


class LayerLeafTracer(fx.Tracer):
    """Plain ``torch.fx`` tracing with the transformer layers (and ``leaf_types``) as leaves:
    NxD's ``tracer_cls="torch"``, for plain torch modules."""

    def __init__(self, layer_types: tuple[type, ...], leaf_types: tuple[type, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.leaf_types = layer_types + leaf_types

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, self.leaf_types) or super().is_leaf_module(module, qualified_name)


def make_tracer(tracer_cls, layer_types: tuple[type, ...], leaf_types: tuple[type, ...], **kwargs) -> fx.Tracer:
    """The tracer for NxD's ``tracer_cls``: None/"hf" (``HFSpineTracer``), "torch"
    (``LayerLeafTracer``) or a user ``fx.Tracer`` subclass, which gets the layers as leaves too."""
    if tracer_cls in (None, "hf"):
        return HFSpineTracer(layer_types, leaf_types, **kwargs)
    if tracer_cls == "torch":
        return LayerLeafTracer(layer_types, leaf_types, **kwargs)
    if isinstance(tracer_cls, type) and issubclass(tracer_cls, fx.Tracer):
        leaves = layer_types + leaf_types

        def is_leaf_module(self, module, qualified_name):
            return isinstance(module, leaves) or tracer_cls.is_leaf_module(self, module, qualified_name)

        return type(f"Layers{tracer_cls.__name__}", (tracer_cls,), {"is_leaf_module": is_leaf_module})(**kwargs)
    raise ValueError(f"tracer_cls must be 'hf', 'torch' or a torch.fx.Tracer subclass, not {tracer_cls!r}")


class _TraceRoot(nn.Module):
    """Calls the model's undecorated forward with the traced inputs as keywords and returns its
    logits for an HF model, else its output as is: the graph the pipeline splits."""

    def __init__(self, model: nn.Module, input_names: list[str]):
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs):
        kwargs = dict(zip(self.input_names, inputs))
        forward = inspect.unwrap(type(self.model).forward)
        if hasattr(self.model, "config"):  # an HF model: no cache, output object
            kwargs.setdefault("use_cache", False)
        out = forward(self.model, **kwargs)
        if isinstance(out, torch.Tensor) or not hasattr(self.model, "loss_function"):
            return out
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out[0]


class _ExtraModules:
    """``get_submodule`` over the traced root plus the tracer's own leaf modules."""

    def __init__(self, root: nn.Module, extra: dict[str, nn.Module]):
        self.root, self.extra = root, extra

    def get_submodule(self, target: str) -> nn.Module:
        return self.extra[target] if target in self.extra else self.root.get_submodule(target)


def trace_hf(model: nn.Module, input_names: list[str], layer_types: tuple[type, ...],
             leaf_types: tuple[type, ...] = (), example_inputs: list[torch.Tensor] | None = None,
             tracer: fx.Tracer | None = None) -> fx.GraphModule:
    """Trace ``model`` called with ``input_names`` (labels excluded) into a GraphModule whose
    submodules keep the model's own names (``model.layers.0``, ...). ``example_inputs`` give
    the placeholders' dtype and rank (default: int64 ``[1, 8]`` each); ``tracer`` defaults to
    an ``HFSpineTracer``."""
    root = _TraceRoot(model, input_names)
    tracer = tracer or HFSpineTracer(layer_types, leaf_types)
    if isinstance(tracer, HFSpineTracer):
        examples = example_inputs or [torch.ones(1, 8, dtype=torch.long) for _ in input_names]
        tracer.example_inputs = dict(zip(input_names, examples))
        tracer.mark_spine(root)
        tracer._spine.add(id(root))
    # positional placeholders named after the inputs
    code = f"def forward(self, {', '.join(input_names)}):\n    return _TraceRoot.forward(self, {', '.join(input_names)})\n"
    namespace = {"_TraceRoot": _TraceRoot}
    exec(code, namespace)  # a signature fx can read: one named argument per input
    root_cls = type("TracedModel", (_TraceRoot,), {"forward": namespace["forward"]})
    root.__class__ = root_cls
    leaves: dict[str, nn.Module] = {}
    patch = patched_mask_builders if isinstance(tracer, HFSpineTracer) else no_patch
    with patch(tracer, model, leaves):
        try:
            graph = tracer.trace(root)
        except (NotImplementedError, TypeError, ValueError) as exc:  # fx's TraceError is a ValueError
            raise ValueError(
                f"cannot trace {type(model).__name__} for pipeline parallelism ({type(exc).__name__}: {exc}); "
                "use pipeline_parallel_size=1, or mark the untraceable modules with leaf_module_cls"
            ) from exc
    root.__class__ = _TraceRoot
    modules = {}
    for node in graph.nodes:  # targets relative to the model itself: "model.layers.0"
        if node.op in ("call_module", "get_attr"):
            if node.target in leaves:
                modules[node.target] = leaves[node.target]
                continue
            node.target = node.target.removeprefix("model.")
            modules[node.target] = model.get_submodule(node.target) if node.op == "call_module" else get_attr(model, node.target)
    return fx.GraphModule(modules, graph, class_name=type(model).__name__ + "Traced")


def get_attr(model: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)
