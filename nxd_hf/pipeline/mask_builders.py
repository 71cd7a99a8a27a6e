"""HF's mask builders as leaf modules of a pipeline trace (``nxd_hf.pipeline.trace``):
``create_causal_mask`` and friends become calls of a ``MaskBuilder`` that returns a materialized
mask, so a stage boundary never carries a value that is a tensor on one batch and None on the
next, unless every stage recomputes the mask itself (``nxd_hf.pipeline.recompute``)."""

import contextlib
import inspect
import sys

import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

MASK_BUILDERS = (
    "create_causal_mask", "create_sliding_window_causal_mask", "create_bidirectional_mask",
    "create_chunked_causal_mask", "create_bidirectional_sliding_window_mask",
)


class MaskBuilder(nn.Module):
    """A leaf module calling an HF mask builder with the model's config. Holding the config here
    keeps it out of the graph. The sdpa shortcut (None for an all-ones mask) is off unless
    ``allow_skip`` is set, which ``nxd_hf.pipeline.recompute`` does when the mask never
    crosses a stage boundary; it is always off on fake tensors (shape propagation), and when
    the model itself passes ``allow_is_causal_skip=False`` (DSA indexers such as AXK2's and
    DeepSeek-V3.2's slice the mask, so it must be a tensor)."""

    def __init__(self, builder, config):
        super().__init__()
        self.builder, self.config = builder, config
        self.accepts_skip = "allow_is_causal_skip" in inspect.signature(builder).parameters
        self.allow_skip = False

    def forward(self, *args, **kwargs):
        kwargs["config"] = self.config
        if self.accepts_skip:
            fake = any(isinstance(v, FakeTensor) for v in [*args, *kwargs.values()])
            kwargs["allow_is_causal_skip"] = kwargs.get("allow_is_causal_skip", True) and self.allow_skip and not fake
        return self.builder(*args, **kwargs)


@contextlib.contextmanager
def patched_mask_builders(tracer: fx.Tracer, root: nn.Module, leaves: dict[str, nn.Module]):
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
                tracer.extra_modules[target] = leaves[target]
                return tracer.create_proxy("call_module", target, args, kwargs)

            patched.append((module, name, builder))
            setattr(module, name, record)
    try:
        yield
    finally:
        for module, name, builder in patched:
            setattr(module, name, builder)


@contextlib.contextmanager
def no_patch(*_):
    yield
