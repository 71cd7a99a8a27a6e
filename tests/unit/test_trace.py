"""The pipeline tracer (``nxd_hf.pipeline.trace``): what it records does not depend on which other
frameworks are installed. transformers' ``is_tracing(x)`` probes ``hasattr(x, "jax")`` and, where
jax is importable, calls ``x.jax()``: a proxy that claimed every attribute left a ``jax`` node no
tensor can run (the GPU lane's image has jax installed)."""

import sys
import types

import pytest
import torch
import torch.fx as fx

from support import hf_parity
from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
from nxd_hf.pipeline.stages import value_kinds
from nxd_hf.pipeline.trace import HFSpineTracer, trace_hf


@pytest.fixture
def jax_importable(monkeypatch):
    """``import jax`` succeeds, as on an image with jax installed (what transformers' probe needs
    of it: ``jax.core.Tracer``)."""
    jax = types.ModuleType("jax")
    jax.core = types.SimpleNamespace(Tracer=type("Tracer", (), {}))
    monkeypatch.setitem(sys.modules, "jax", jax)


def _trace(model_type):
    _, model = hf_parity.build_pair(model_type, num_hidden_layers=2)
    examples = [torch.ones(1, 8, dtype=torch.long)] * 2
    graph_module = trace_hf(model, ["input_ids", "attention_mask"], decoder_layer_types(model), (), examples)
    value_kinds(graph_module, examples)  # fake propagation runs every node
    return [(n.op, str(n.target)) for n in graph_module.graph.nodes]


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])  # gpt2 checks its input_ids with is_tracing
def test_the_same_graph_with_jax_importable(model_type, request):
    without = _trace(model_type)
    request.getfixturevalue("jax_importable")
    with_jax = _trace(model_type)
    assert ("call_method", "jax") not in with_jax
    assert with_jax == without


def test_a_proxy_has_the_attributes_of_its_tensor_only():
    class Probe(torch.nn.Module):
        def forward(self, x):
            assert not hasattr(x, "jax") and not hasattr(x, "numpy_array") and not hasattr(x, "_tf_tensor")
            assert hasattr(x, "shape") and hasattr(x, "view") and hasattr(x, "dtype")
            return x.view(-1).size(0) + x.sum()

    tracer = HFSpineTracer(layer_types=())
    tracer.example_inputs = {"x": torch.ones(2, 3)}
    graph = tracer.trace(Probe())
    assert [(n.op, n.target) for n in graph.nodes if n.op == "call_method"] == [
        ("call_method", "view"), ("call_method", "size"), ("call_method", "sum")]
    assert torch.equal(fx.GraphModule(Probe(), graph)(torch.ones(2, 3)), torch.full((), 12.0))
