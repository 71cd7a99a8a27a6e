"""One fake run per kind of transformer layer.

Tracing a model and computing its stages' metadata run every layer on fake tensors, op by op
through ``FakeTensorMode``: most of a pipeline's setup time, and as many runs as the model has
layers. A model's layers are mostly alike, and what is read of a layer's fake output is its
shapes, strides, dtypes and ``requires_grad``: a layer of the same class, with parameters and
buffers of the same names, shapes, dtypes and ``requires_grad``, called on inputs with the same
such metadata (and equal non-tensor arguments) under the same grad mode, returns the same
metadata. Such a call gets fresh fake tensors like the first one's outputs instead of a run.
Layers that differ in their parameters (a dense layer before MoE ones) or take an argument that
is neither a tensor nor a plain value run as before.
"""

import torch
import torch.utils._pytree as pytree
from torch import nn

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


class LayerFakeRuns:
    """Remembers fake outputs of ``layer_types`` calls within one fake-tensor run."""

    def __init__(self, layer_types: tuple[type, ...]):
        self.layer_types = layer_types
        self._outputs: dict = {}

    def call(self, module: nn.Module, args: tuple, kwargs: dict, run):
        """``run()``'s result, or fresh fake tensors like an equal call's earlier result."""
        key = _call_key(module, args, kwargs) if isinstance(module, self.layer_types) else None
        if key is None:
            return run()
        if key in self._outputs:
            return pytree.tree_map_only(torch.Tensor, _like, self._outputs[key])
        output = run()
        if all(isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in pytree.tree_leaves(output)):
            self._outputs[key] = output  # not an output holding other objects: they would be shared
        return output


def _like(t: torch.Tensor) -> torch.Tensor:
    # inside the caller's FakeTensorMode: a new fake tensor, no compute
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def _tensor_key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad


def _call_key(module: nn.Module, args: tuple, kwargs: dict):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    values = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            values.append(_tensor_key(leaf))
        elif isinstance(leaf, _PLAIN):
            values.append((type(leaf), leaf))
        else:  # a cache, a config, a callable: its effect on the output is unknown
            return None
    state = tuple((name, _tensor_key(t)) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                          *module.named_buffers(remove_duplicate=False)])
    structure = tuple((name, type(m)) for name, m in module.named_modules())
    return structure, state, str(spec), tuple(values), torch.is_grad_enabled()
