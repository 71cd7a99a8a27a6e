"""Cut a traced model into pipeline stage modules.

Every node runs on one stage: a transformer layer on the stage its cut assigns, any other node
on the stage of the last layer before it (stage 0 before the first layer). A value made on one
stage and used on a later one is passed along every stage in between. Values crossing a
boundary are flattened to tensors — a tuple (RoPE's cos/sin) becomes its items, a None is not
sent, a shape (an int or tuple of ints, e.g. GPT-2's output shape) travels as an int64 tensor —
using the value kinds found by shape propagation with fake tensors. A module that is not Hugging
Face's is split before its value kinds are known (its input dtypes and shapes are unknown): a
value that turns out None for a batch (a mask it builds only when given one) is then dropped from
that boundary's sends and handed to the next stage as None (``NoneAtBoundary``).
"""

import contextlib
import operator

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from nxd_hf import backend
from nxd_hf.pipeline.fake_experts import fake_safe_experts
from nxd_hf.pipeline.fake_memo import LayerFakeRuns
from nxd_hf.pipeline.trace import FAKE_FAILED
from nxd_hf.parallel_layers.sharding import copy_tensor_model_parallel_attributes


def fake_propagate(gm: fx.GraphModule, example_inputs: list[torch.Tensor], layer_types: tuple[type, ...] = ()) -> None:
    """Record every node's fake value in ``node.meta["val"]``: no real compute, no
    communication. Parameters and buffers are replaced by fake tensors on the inputs' device,
    so a model whose non-local stages are still on the meta device propagates too. Alike
    ``layer_types`` calls run once (``LayerFakeRuns``)."""
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = example_inputs[0].device
    fake_inputs = [mode.from_tensor(t) for t in example_inputs]
    with mode, torch.enable_grad(), fake_safe_experts():  # unlike FakeTensorProp, keeps requires_grad
        state = {
            name: torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(t.requires_grad)
            for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
        }
        originals = dict([*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)])
        for name, fake in state.items():  # layers read their shard_index (replicated K/V) in forward
            copy_tensor_model_parallel_attributes(fake, originals[name])
        with _reparametrize_module(gm, state, strict=False), _fsdp_hooks_off(gm):
            _RecordingInterpreter(gm, LayerFakeRuns(layer_types)).run(*fake_inputs)


@contextlib.contextmanager
def _fsdp_hooks_off(gm: fx.GraphModule):
    """Without FSDP2's forward hooks (ZeRO-2/3, ``nxd_hf.fsdp``) on every module of ``gm``: they
    would all-gather fake shards, over groups the other ranks do not join. That covers a layer the
    graph calls and an FSDP group inside it (the experts under expert parallelism, called by the
    layer's own code). FSDP2 has no public switch for them: its two hook handles are taken out of
    the module's hook dicts, which are restored as they were, order included."""
    from torch.distributed.fsdp import FSDPModule

    saved = []
    for module in gm.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        ids = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            saved.append((hooks, dict(hooks)))
            for key in ids & hooks.keys():
                del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)


class MetadataByShape:
    """The stages' metadata (``NxDPPModel.stage_metadata``) per signature of the microbatch (each
    input's shape, dtype and device) and of ``gm``'s parameters (dtype, requires_grad), from
    ``compute``: a fake run of the whole model, the costly part of building a schedule. A training
    schedule's run serves an evaluation schedule at the same shape (evaluation only runs forward:
    which boundary values require grad does not matter there, and a module's training flag changes
    values, not shapes), not the other way: a forward that skips the trained path (DPO's reference
    pass, LoRA's adapters disabled) leaves the boundaries not requiring grad, and training's
    backward would then stop at the stage's input."""

    def __init__(self, compute, gm: fx.GraphModule):
        self._compute, self._gm, self._cache = compute, gm, {}

    def __call__(self, microbatch_inputs: list, *, train: bool) -> dict:
        key = (tuple(None if t is None else (tuple(t.shape), t.dtype, t.device.type) for t in microbatch_inputs),
               tuple((p.dtype, p.requires_grad) for p in self._gm.parameters()))
        cached = self._cache.get(key)
        if cached is None or (train and not cached[0]):
            cached = self._cache[key] = (train, self._compute(microbatch_inputs))
        return cached[1]


class _RecordingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, layer_runs: LayerFakeRuns):
        super().__init__(gm)
        self.layer_runs = layer_runs

    def call_module(self, target, args, kwargs):
        return self.layer_runs.call(self.fetch_attr(target), args, kwargs,
                                    lambda: super(_RecordingInterpreter, self).call_module(target, args, kwargs))

    def run_node(self, node: fx.Node):
        value = super().run_node(node)
        node.meta["val"] = value
        return value


def value_kinds(gm: fx.GraphModule, example_inputs: list[torch.Tensor],
                layer_types: tuple[type, ...] = ()) -> dict[str, object]:
    """Node name -> "tensor", a tuple length, None, "int" or "ints", from a fake-tensor run: the
    one ``HFSpineTracer`` made while tracing on these ``example_inputs`` when it valued every node
    (a second run costs as much as the trace again), else a new one."""
    if _traced_values_complete(gm):  # the output's value, as a run would record it
        output = next(n for n in gm.graph.nodes if n.op == "output")
        output.meta["val"] = fx.node.map_arg(output.args[0], lambda n: n.meta["val"])
    else:
        fake_propagate(gm, example_inputs, layer_types)
    kinds = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            kinds[node.name] = "tensor"
        elif isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
            kinds[node.name] = len(value)
        elif value is None:
            kinds[node.name] = None
        elif isinstance(value, int):
            kinds[node.name] = "int"
        elif isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
            kinds[node.name] = "ints"
        else:
            kinds[node.name] = "other"
    return kinds


def _traced_values_complete(gm: fx.GraphModule) -> bool:
    """Whether the tracer recorded a fake value for every node but the output. Not after a failed
    one, nor with ``get_attr`` nodes, which the tracer leaves unvalued (an operation on one may
    have been valued from a None)."""
    return not any(n.op == "get_attr" or "val" not in n.meta or n.meta.get(FAKE_FAILED)
                   for n in gm.graph.nodes if n.op != "output")


def assign_stages(gm: fx.GraphModule, stage_of_layer: dict[str, int]) -> dict[fx.Node, int]:
    assignment, current = {}, 0
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in stage_of_layer:
            current = stage_of_layer[node.target]
        assignment[node] = current if node.op != "output" else max(stage_of_layer.values())
    return assignment


def _make_tuple(*items):
    return tuple(items)


def _shape_to_tensor(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.long, device=backend.default_device())  # sent to the next stage


def _tensor_to_ints(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.tolist())


def _tensor_to_int(t: torch.Tensor) -> int:
    return int(t.item())


def boundaries(gm: fx.GraphModule, stage_of_layer: dict[str, int],
               recomputed: set[fx.Node] = frozenset()) -> list[list[fx.Node]]:
    """For each boundary s|s+1, the values made at or before stage s and used after it, except
    those every stage recomputes (``recomputed``, see ``nxd_hf.pipeline.recompute``)."""
    assignment = assign_stages(gm, stage_of_layer)
    num_stages = max(stage_of_layer.values()) + 1
    nodes = [n for n in gm.graph.nodes if n not in recomputed]
    return [[n for n in nodes if n.op != "output" and assignment[n] <= boundary
             and any(assignment[u] > boundary for u in n.users)] for boundary in range(num_stages - 1)]


def flat_boundary_values(nodes: list[fx.Node], kinds: dict[str, object]) -> list[torch.Tensor | None]:
    """The tensors a boundary carries, from the nodes' fake values (``fake_propagate``); None
    where a value split as a tensor (a module that is not HF's) is None for these inputs."""
    flat = []
    for node in nodes:
        kind, value = kinds[node.name], node.meta["val"]
        if kind == "tensor" and value is None:
            flat.append(None)
        elif kind == "tensor" and not isinstance(value, torch.Tensor):  # a module that is not HF's: kinds unknown
            raise ValueError(
                f"{node.name} ({type(value).__name__}, not a tensor) crosses a pipeline stage boundary, where a module that is not "
                "Hugging Face's may pass only tensors (its values are not known when it is split): compute it inside "
                "the transformer_layer_cls layers that use it, or pass it as a tensor")
        elif kind == "tensor":
            flat.append(value)
        elif kind in ("int", "ints"):
            flat.append(torch.empty(() if kind == "int" else (len(value),), dtype=torch.long, device="meta"))
        elif kind is not None:
            flat.extend(value)
    return flat


class NoneAtBoundary(nn.Module):
    """A stage whose boundary values include some that are None for this input signature: they
    are not sent (torch's stages send tensors only). ``none_in``: the positions of the stage's
    inputs that arrive as None (re-inserted before ``stage`` runs); ``none_out``: the positions
    of its outputs that are None (dropped). Built per input signature around the same stage."""

    def __init__(self, stage: nn.Module, none_in: list[int], none_out: list[int]):
        super().__init__()
        self.stage, self.none_in, self.none_out = stage, none_in, none_out

    def forward(self, *args):
        args = list(args)
        for position in self.none_in:  # ascending: each insert lands at its final position
            args.insert(position, None)
        outputs = self.stage(*args)
        if not self.none_out:
            return outputs
        if any(outputs[i] is not None for i in self.none_out) or any(
                o is None for i, o in enumerate(outputs) if i not in self.none_out):
            raise ValueError(f"{type(self.stage).__name__}: a value crossing a pipeline stage boundary is None on "
                             "some batches of one shape and a tensor on others; pass it as a tensor on every batch "
                             "(e.g. an all-ones attention_mask) or compute it inside the layers that use it")
        return tuple(o for i, o in enumerate(outputs) if i not in self.none_out)


def none_positions(flat: list[torch.Tensor | None]) -> list[int]:
    return [i for i, value in enumerate(flat) if value is None]


def split_stages(gm: fx.GraphModule, stage_of_layer: dict[str, int], kinds: dict[str, object],
                 recomputed: set[fx.Node] = frozenset(),
                 substitutes: list[dict[fx.Node, fx.Node]] | None = None) -> list[fx.GraphModule]:
    """One GraphModule per stage; stage s takes the flattened boundary values from stage s-1
    and, when nodes are ``recomputed``, the model inputs those read as keyword arguments.
    ``substitutes[s]``: for each value recomputed nodes read only for its metadata, the
    boundary s|s+1 tensor that stands in for it."""
    assignment = assign_stages(gm, stage_of_layer)
    num_stages = max(stage_of_layer.values()) + 1
    nodes = list(gm.graph.nodes)
    crossings = boundaries(gm, stage_of_layer, recomputed)
    shared = [n for n in nodes if n.op == "placeholder" and n in recomputed]

    def crossing(boundary: int) -> list[fx.Node]:
        return crossings[boundary]

    stages = []
    for stage in range(num_stages):
        graph, env = fx.Graph(), {}
        if stage == 0:
            inputs = [n for n in nodes if n.op == "placeholder"]
        else:
            inputs = crossing(stage - 1)

        def local(node: fx.Node, stage=stage, graph=graph, env=env) -> fx.Node:
            """This stage's copy of ``node``: made here, received, or recomputed on demand."""
            if node not in env:
                if node not in recomputed:  # read for its metadata only: the incoming stand-in
                    return env[substitutes[stage - 1][node]]
                env[node] = graph.node_copy(node, local)
            return env[node]
        for node in inputs:
            kind = kinds[node.name] if stage else "tensor"
            if kind == "other":
                raise ValueError(f"pipeline stage boundary would carry {node.name}, which is not a tensor")
            if kind is None:
                env[node] = None
            elif kind == "tensor" or node.op == "placeholder":
                env[node] = graph.placeholder(node.name)
            elif kind in ("int", "ints"):
                decode = _tensor_to_int if kind == "int" else _tensor_to_ints
                env[node] = graph.call_function(decode, (graph.placeholder(node.name),))
            else:
                items = [graph.placeholder(f"{node.name}_{i}") for i in range(kind)]
                env[node] = graph.call_function(_make_tuple, tuple(items))
        if stage:
            env.update({node: graph.placeholder(node.name) for node in shared})
        for node in nodes:
            if assignment[node] == stage and node.op not in ("placeholder", "output") and node not in env:
                env[node] = graph.node_copy(node, local)
        if stage == num_stages - 1:
            output = next(n for n in nodes if n.op == "output")
            graph.output(fx.map_arg(output.args[0], local))
        else:
            flat = []
            for node in crossing(stage):
                kind = kinds[node.name]
                if kind == "tensor":
                    flat.append(env[node])
                elif kind in ("int", "ints"):
                    flat.append(graph.call_function(_shape_to_tensor, (env[node],)))
                elif isinstance(kind, int) and not isinstance(kind, bool):
                    flat.extend(graph.call_function(operator.getitem, (env[node], i)) for i in range(kind))
            graph.output(tuple(flat))
        targets = {n.target for n in graph.nodes if n.op in ("call_module", "get_attr")}
        owned = {t: _lookup(gm, t) for t in targets}
        stages.append(fx.GraphModule(owned, graph, class_name=f"Stage{stage}"))
    return stages


def _lookup(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
