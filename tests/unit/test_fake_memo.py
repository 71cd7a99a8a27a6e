"""One fake run per kind of transformer layer (``nxd_hf.pipeline.fake_memo``): tracing and the
stages' metadata run a layer on fake tensors once per distinct (parameters, inputs) signature,
and every node gets the shape, dtype and requires_grad the run of every layer gives it."""

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

from support import hf_parity
from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
from nxd_hf.pipeline.fake_memo import LayerFakeRuns
from nxd_hf.pipeline.stages import fake_propagate
from nxd_hf.pipeline.trace import HFSpineTracer, trace_hf

INPUTS = ["input_ids", "attention_mask"]


@pytest.fixture
def layer_runs(monkeypatch):
    """How many times a LlamaDecoderLayer's forward ran."""
    runs = []
    forward = modeling_llama.LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        runs.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", counted)
    return runs


def _metadata(graph_module) -> dict:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype, value.requires_grad
        if isinstance(value, (tuple, list)):
            return tuple(describe(v) for v in value)
        return value
    return {n.name: describe(n.meta.get("val")) for n in graph_module.graph.nodes if n.op != "output"}


def _trace(model, memo: bool):
    tracer = HFSpineTracer(decoder_layer_types(model))
    if not memo:
        tracer.layer_runs = LayerFakeRuns(())
    examples = [torch.ones(1, 8, dtype=torch.long)] * 2
    return trace_hf(model, INPUTS, decoder_layer_types(model), (), examples, tracer)


def _propagate(graph_module, layer_types) -> dict:
    microbatch = [torch.ones(2, 6, dtype=torch.long)] * 2
    fake_propagate(graph_module, microbatch, layer_types)
    return _metadata(graph_module)


def _model(frozen: list[str]):
    _, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    for name, param in model.named_parameters():
        param.requires_grad_(not any(name.startswith(prefix) for prefix in frozen))
    return model


@pytest.mark.parametrize("frozen, kinds", [
    ([], 1),  # four alike layers
    (["model.layers.0."], 2),  # a frozen first layer differs from the others
    # frozen up to the last layer: their outputs need no grad, the last one's do
    (["model.embed_tokens", "model.layers.0.", "model.layers.1.", "model.layers.2."], 2),
])
def test_one_run_per_kind_of_layer_and_the_values_of_a_run_of_each(layer_runs, frozen, kinds):
    model = _model(frozen)
    traced = _trace(model, memo=True)
    assert len(layer_runs) == kinds, "the tracer ran a layer per kind"
    traced_values = _metadata(traced)
    layer_runs.clear()
    propagated = _propagate(traced, decoder_layer_types(model))
    assert len(layer_runs) == kinds, "the stages' metadata ran a layer per kind"

    every_layer = _trace(model, memo=False)
    assert len(layer_runs) == kinds + 4
    assert traced_values == _metadata(every_layer)
    assert propagated == _propagate(every_layer, ())
    layers = [n for n in traced.graph.nodes if n.op == "call_module" and n.target.startswith("model.layers.")]
    assert [propagated[n.name][2] for n in layers] == [
        not frozen or i == 3 or frozen == ["model.layers.0."] for i in range(4)]


def test_an_argument_of_unknown_effect_is_run_each_time():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, scale):
            return self.linear(x) * scale.factor

    class Scale:
        factor = 2.0

    memo, calls = LayerFakeRuns((Layer,)), []
    layers = [Layer(), Layer()]
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 4)
        for layer in layers:
            memo.call(layer, (x, Scale()), {}, lambda: calls.append(1) or layer(x, Scale()))
            memo.call(layer, (x,), {"scale": 2.0}, lambda: calls.append(2) or layer.linear(x) * 2.0)
    assert calls == [1, 2, 1], "an object argument runs every time; a float one once"
