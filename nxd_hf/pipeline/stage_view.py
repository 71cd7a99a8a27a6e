"""``NxDPPModel.local_module`` as NxD users see it: NxD's split stage module has the modules it
calls as direct children, so code written for NxD walks ``local_module.named_children()`` to
find the transformer layers and swaps them with ``add_module``. nxd_hf's stage modules keep
the Hugging Face module tree (parameter names stay the HF ones), so the view lists the
modules the stage's graph calls, by their dotted paths, and replaces them in that tree; the
graph looks its modules up by path at every call, so a replacement takes effect."""

from torch import fx, nn


class StageView:
    """One stage module (``module``), with NxD's children (see the module docstring)."""

    def __init__(self, module: nn.Module):
        object.__setattr__(self, "module", module)

    def named_children(self):
        module = self.module
        if not isinstance(module, fx.GraphModule):
            yield from module.named_children()
            return
        seen = set()
        for node in module.graph.nodes:
            if node.op == "call_module" and node.target not in seen:
                seen.add(node.target)
                yield node.target, module.get_submodule(node.target)

    def children(self):
        return (child for _, child in self.named_children())

    def add_module(self, name: str, child: nn.Module) -> None:
        parent, _, attr = name.rpartition(".")
        (self.module.get_submodule(parent) if parent else self.module).add_module(attr, child)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.module, name, value)

    def __repr__(self) -> str:
        return f"StageView({self.module!r})"
