"""NxD's ``NxDPPModel`` arguments as NxD code passes them: the ``num_microbatches`` default,
a dict ``output_loss_value_spec``, positional or dict inputs to ``run_train``/``run_eval``, and
transformer-layer calls whose keyword arguments come in signature order."""

import inspect
import warnings
from collections.abc import Mapping

from nxd_hf import parallel_state

_warned = False


def default_microbatches(num_microbatches: int | None) -> int:
    """NxD's default is 1 microbatch; torch's 1F1B schedule needs one per stage at least, so
    with PP and no ``num_microbatches`` given, one per pipeline rank (warned once)."""
    global _warned
    pp_size = parallel_state.get_pipeline_model_parallel_size()
    if num_microbatches is not None:
        return num_microbatches
    if pp_size == 1:
        return 1
    if not _warned:
        _warned = True
        warnings.warn(f"num_microbatches not given: using {pp_size} (one per pipeline stage, the fewest the "
                      "pipeline schedules run); pass num_microbatches= to choose", stacklevel=4)
    return pp_size


def layer_kwargs_in_signature_order(graph_module, layer_types: tuple[type, ...]) -> None:
    """Each transformer layer call passes its keyword arguments in the order of the layer's
    forward signature (HF calls them in another order): NxD's activation-checkpointing sample
    wraps layers in a module that hands keyword arguments on positionally, in call order."""
    for node in graph_module.graph.nodes:
        if node.op != "call_module" or not isinstance(graph_module.get_submodule(node.target), layer_types):
            continue
        order = list(inspect.signature(graph_module.get_submodule(node.target).forward).parameters)
        node.kwargs = dict(sorted(node.kwargs.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    graph_module.recompile()


def outputs_as_tuple(graph_module, spec):
    """A traced module returning a dict returns its values as a tuple instead (torch's stages
    hand on tuples of tensors); a dict ``output_loss_value_spec`` becomes the matching tuple."""
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    value = output.args[0]
    if not isinstance(value, dict):
        if isinstance(spec, dict):
            raise ValueError(f"output_loss_value_spec is a dict {spec} but the module's forward does not return a "
                             "dict: give a tuple of bools, one per output")
        return spec
    keys = list(value)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(keys))
        if unknown or sum(map(bool, spec.values())) != 1:
            raise ValueError(f"output_loss_value_spec {spec} must mark exactly one of the forward's outputs "
                             f"{keys} True{f'; unknown: {unknown}' if unknown else ''}")
        spec = tuple(bool(spec.get(k, False)) for k in keys)
    output.args = (tuple(value[k] for k in keys),)
    graph_module.recompile()
    return spec


def named_inputs(input_names: list[str], args: tuple, inputs: dict) -> dict:
    """Positional inputs in ``input_names`` order (or one dict, a tokenizer's batch) as keywords."""
    if len(args) == 1 and isinstance(args[0], Mapping):
        args, inputs = (), {**args[0], **inputs}
    if len(args) > len(input_names):
        raise ValueError(f"got {len(args)} positional inputs but input_names has {len(input_names)}: {input_names}")
    named = dict(zip(input_names, args))
    twice = sorted(set(named) & set(inputs))
    if twice:
        raise ValueError(f"inputs {twice} given both positionally and by name")
    return {**named, **inputs}
