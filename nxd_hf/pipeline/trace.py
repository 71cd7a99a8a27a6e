"""An FX tracer for Hugging Face models in transformers 5.x.

Plain ``torch.fx`` fails on HF's decorated ``forward`` methods (``*args/**kwargs`` wrappers
that capture outputs and merge config defaults), and HF's own ``HFTracer`` is gone. This tracer
records only the model's spine — the modules on the path from the root to the transformer
layers — and treats everything else as a leaf:

- each module's undecorated ``forward`` (``inspect.unwrap``) is traced, so wrappers never see
  proxies;
- transformer layers, parallel layers, embeddings, norms, rotary embeddings — every module that
  does not contain a transformer layer — are leaves (called, not traced);
- HF mask builders (``create_causal_mask`` and friends) become leaf function calls that always
  return a materialized mask (``allow_is_causal_skip=False``), so a stage boundary never carries
  a value that is a tensor on one batch and None on the next;
- the model is traced without labels: the pipeline's last stage applies the model's own
  ``loss_function`` to the logits (see ``nxd_hf.pipeline.model``).
"""

import contextlib
import inspect
import sys

import torch
import torch.fx as fx
from torch import nn

MASK_BUILDERS = (
    "create_causal_mask", "create_sliding_window_causal_mask", "create_bidirectional_mask",
    "create_chunked_causal_mask", "create_bidirectional_sliding_window_mask",
)


class MaskBuilder(nn.Module):
    """A leaf module calling an HF mask builder with the model's config and the sdpa shortcut
    (None for an all-ones mask) turned off. Holding the config here keeps it out of the graph."""

    def __init__(self, builder, config):
        super().__init__()
        self.builder, self.config = builder, config
        self.accepts_skip = "allow_is_causal_skip" in inspect.signature(builder).parameters

    def forward(self, *args, **kwargs):
        kwargs["config"] = self.config
        if self.accepts_skip:
            kwargs["allow_is_causal_skip"] = False
        return self.builder(*args, **kwargs)


class HFSpineTracer(fx.Tracer):
    """Traces only modules that contain a transformer layer (see the module docstring)."""

    def __init__(self, layer_types: tuple[type, ...], leaf_types: tuple[type, ...] = (), **kwargs):
        super().__init__(**kwargs)
        self.layer_types, self.leaf_types = layer_types, leaf_types
        self._spine: set[int] = set()

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
        if not self.is_leaf_module(module, self.path_of_module(module)):
            forward = inspect.unwrap(type(module).forward).__get__(module)  # skip HF's decorators
        return super().call_module(module, forward, args, kwargs)


@contextlib.contextmanager
def _patched_mask_builders(tracer: fx.Tracer, root: nn.Module, leaves: dict[str, nn.Module]):
    """Replace HF mask builders in the modeling modules' globals by leaf-module calls while
    tracing; the leaf modules are collected in ``leaves`` under their graph targets."""
    patched = []
    modules = {sys.modules[type(m).__module__] for m in root.modules()}
    for module in modules:
        for name in MASK_BUILDERS:
            builder = getattr(module, name, None)
            if builder is None:
                continue

            def record(*args, _builder=builder, **kwargs):
                target = f"nxd_{_builder.__name__}_{len(leaves)}"
                leaves[target] = MaskBuilder(_builder, kwargs.pop("config"))
                return tracer.create_proxy("call_module", target, args, kwargs)

            patched.append((module, name, builder))
            setattr(module, name, record)
    try:
        yield
    finally:
        for module, name, builder in patched:
            setattr(module, name, builder)


class _TraceRoot(nn.Module):
    """Calls the model's undecorated forward with the traced inputs as keywords and returns its
    logits (or the first output): the graph the pipeline splits."""

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
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out[0]


def trace_hf(model: nn.Module, input_names: list[str], layer_types: tuple[type, ...],
             leaf_types: tuple[type, ...] = ()) -> fx.GraphModule:
    """Trace ``model`` called with ``input_names`` (labels excluded) into a GraphModule whose
    submodules keep the model's own names (``model.layers.0``, ...)."""
    root = _TraceRoot(model, input_names)
    tracer = HFSpineTracer(layer_types, leaf_types)
    tracer.mark_spine(root)
    tracer._spine.add(id(root))
    # positional placeholders named after the inputs
    code = f"def forward(self, {', '.join(input_names)}):\n    return _TraceRoot.forward(self, {', '.join(input_names)})\n"
    namespace = {"_TraceRoot": _TraceRoot}
    exec(code, namespace)  # a signature fx can read: one named argument per input
    root_cls = type("TracedModel", (_TraceRoot,), {"forward": namespace["forward"]})
    root.__class__ = root_cls
    leaves: dict[str, nn.Module] = {}
    with _patched_mask_builders(tracer, model, leaves):
        graph = tracer.trace(root)
    root.__class__ = _TraceRoot
    modules = {}
    for node in graph.nodes:  # targets relative to the model itself: "model.layers.0"
        if node.op in ("call_module", "get_attr"):
            if node.target in leaves:
                modules[node.target] = leaves[node.target]
                continue
            node.target = node.target.removeprefix("model.")
            modules[node.target] = model.get_submodule(node.target) if node.op == "call_module" else _get_attr(model, node.target)
    return fx.GraphModule(modules, graph, class_name=type(model).__name__ + "Traced")


def _get_attr(model: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)
