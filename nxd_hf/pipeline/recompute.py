"""Values every pipeline stage recomputes from the model inputs instead of receiving them.

HF decoders compute, before the first layer, values that depend on the inputs only: position
ids, the attention mask, RoPE's cos/sin. Sending them across every boundary would cost extra
point-to-point transfers per microbatch, and a mask that crosses a boundary must be
materialized on every step (a boundary's shapes are static, so it can never be None), which
rules out the unmasked causal attention kernels. So every stage that uses such a value
recomputes it:

- the model inputs (``input_ids``, ``attention_mask``, ...) reach every stage as keyword
  arguments (``nxd_hf.pipeline.step``); a stage with no recomputed node ignores them;
- a recomputable node is a placeholder of those inputs, a buffer, or a parameter-free
  computation (no transformer layer) on recomputable nodes;
- it may also read a non-recomputable hidden state for its metadata only: ``.shape``,
  ``.device``, ``.dtype``, ``.size()``, a mask builder's ``inputs_embeds``, a rotary
  embedding's first argument. A stage reads those from its own incoming hidden state, which
  has the same shape and dtype (checked on the fake values; otherwise nothing is recomputed).
"""

import torch.fx as fx
from torch import nn

from nxd_hf.pipeline.mask_builders import MaskBuilder
from nxd_hf.pipeline.trace import get_attr

METADATA_ATTRS = ("shape", "device", "dtype")
METADATA_METHODS = ("size", "dim")


def _metadata_args(node: fx.Node, module: nn.Module | None) -> set:
    """Positions and keywords of ``node``'s arguments that it reads for metadata only."""
    if node.op == "call_function" and node.target is getattr and node.args[1] in METADATA_ATTRS:
        return {0}
    if node.op == "call_method" and node.target in METADATA_METHODS:
        return {0}
    if isinstance(module, MaskBuilder):
        return {"inputs_embeds", "input_embeds"}
    if module is not None and type(module).__name__.endswith("RotaryEmbedding"):
        return {0, "x"}
    return set()


def _arguments(node: fx.Node):
    """(position or keyword, input node) for every node among ``node``'s arguments."""
    for key, value in [*enumerate(node.args), *node.kwargs.items()]:
        found = []
        fx.node.map_arg(value, found.append)
        for arg in found:
            yield key, arg


def recomputable_nodes(gm: fx.GraphModule, shared_inputs: list[str],
                     layer_targets: set[str]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(nodes any stage can recompute, non-recomputable nodes they read for metadata only)."""
    recomputable, sources = set(), set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.target in shared_inputs:
                recomputable.add(node)
            continue
        if node.op == "output":
            continue
        if node.op == "get_attr":
            value = get_attr(gm, node.target)
            if not isinstance(value, nn.Parameter) and not getattr(value, "requires_grad", False):
                recomputable.add(node)
            continue
        module = None
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if node.target in layer_targets or any(True for _ in module.parameters()):
                continue
        metadata_args, read = _metadata_args(node, module), []
        for key, arg in _arguments(node):
            if arg in recomputable:
                continue
            if key not in metadata_args:
                break
            read.append(arg)
        else:
            recomputable.add(node)
            sources.update(read)
    return recomputable, sources


def metadata_substitutes(crossings: list[list[fx.Node]], sources: set[fx.Node],
                         kinds: dict[str, object]) -> list[dict[fx.Node, fx.Node]] | None:
    """For each boundary, source -> the crossing tensor with the same shape and dtype (fake
    values), or None when some boundary has no such tensor."""
    substitutes = []
    for crossing in crossings:
        tensors = [n for n in crossing if kinds.get(n.name) == "tensor"]
        found = {}
        for source in sources:
            want = source.meta.get("val")
            match = next((n for n in tensors if want is not None and _same_metadata(n.meta.get("val"), want)), None)
            if match is None:
                return None
            found[source] = match
        substitutes.append(found)
    return substitutes


def _same_metadata(a, b) -> bool:
    return getattr(a, "shape", None) == b.shape and getattr(a, "dtype", None) == b.dtype


def allow_unmasked_attention(gm: fx.GraphModule, recomputed: set[fx.Node]) -> None:
    """Mask builders whose masks never cross a boundary may return None for an all-ones mask
    (HF's shortcut to causal attention without a mask tensor)."""
    for node in recomputed:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, MaskBuilder):
                module.allow_skip = True
