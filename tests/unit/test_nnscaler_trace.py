"""``nxd_hf.nnscaler``'s tracer (``nxd_hf.fx_tp.tracer``) in-process: modules written as people
write them trace with their dummy inputs (shapes read from tensors, tensor factories sized by
them, Python control flow on shapes, nn.MultiheadAttention, buffers, tied parameters, submodules
called twice), the graphs equal the module on other shapes too, the derived tensor-parallel layout
stays exact, and what cannot be traced names the line and the construct."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.nnscaler_models import TOL, MaskDecoder
from nxd_hf.fx_tp.derive import derive_layouts, trace


class Idioms(nn.Module):
    """One of each construct the tracer must handle."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(32, d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def attend(self, x, mask):
        B, S, D = x.shape
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))

    def forward(self, x):
        S = x.shape[1]
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        pos = torch.arange(S, device=x.device)
        h = self.embed(x) * self.scale + pos[None, :, None] * 0.01 + torch.zeros(x.size(0), S, 1)
        h = h + torch.full((S, 1), 0.5) + torch.empty(S, 1).fill_(0.25)
        for _ in range(2):  # the same submodules called twice
            h = h + self.attend(h, mask)
        if S > 1:  # Python control flow on a shape: the dummy inputs' branch
            h = h * 1.5
        m, _ = self.mha(h, h, h, attn_mask=~mask, need_weights=False)
        return self.head(h + m)


@pytest.mark.parametrize("training", [True, False])
def test_idioms_trace_and_run_on_other_shapes(training):
    module = Idioms().train(training)
    traced = trace(module, {"x": torch.randint(0, 32, (2, 8))})
    for shape in ((2, 8), (3, 5)):  # shapes stay symbolic: the graph runs other batch and sequence sizes
        x = torch.randint(0, 32, shape)
        with torch.no_grad():
            torch.testing.assert_close(traced.graphs[training](x), module(x), **TOL)
    assert module.training is training


def test_tracing_leaves_buffers_rng_and_inputs_as_they_were():
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    before, x_before = {k: v.clone() for k, v in module.state_dict().items()}, x.clone()
    torch.manual_seed(1)
    trace(module, {"input": x})
    drawn = torch.rand(3)
    torch.manual_seed(1)
    torch.testing.assert_close(drawn, torch.rand(3))
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, before[k], msg=k)
    torch.testing.assert_close(x, x_before)


def test_decoder_layout_stays_exact():
    traced = trace(MaskDecoder(), {"data": {"input_ids": torch.zeros(2, 8, dtype=torch.long),
                                            "labels": torch.zeros(2, 8, dtype=torch.long)}})
    layouts = derive_layouts(traced, 2)
    for i in range(2):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            assert layouts[f"layers.{i}.{name}"] == "column", (name, layouts)
        assert layouts[f"layers.{i}.attn.o"] == layouts[f"layers.{i}.mlp.down"] == "row"
    assert layouts["embed"] == layouts["pos"] == "vocab" and "head" not in layouts


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.up2, self.down2 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        x = self.down(F.relu(self.up(x)))
        x = self.down(F.relu(self.up(x)))  # the same pair twice: still column -> row
        return self.down2(F.relu(self.up2(x))) + self.up2(x).sum(-1, keepdim=True)  # up2's 2nd output is reduced


def test_a_module_called_twice_has_one_layout():
    layouts = derive_layouts(trace(CalledTwice(), {"x": torch.randn(2, 8)}), 2)
    assert layouts == {"up": "column", "down": "row"}  # up2 cannot be column at one call and whole at the other


class DataBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class DataSize(nn.Module):
    def forward(self, x):
        return x[: int(x.sum().item())]


@pytest.mark.parametrize("module, construct", [(DataBranch(), "if x.sum() > 0"), (DataSize(), "x.sum().item()")])
def test_untraceable_names_the_line_and_the_construct(module, construct):
    with pytest.raises(ValueError, match="data-dependent control flow") as error:
        trace(module, {"x": torch.ones(3)})
    assert construct in str(error.value) and "test_nnscaler_trace.py" in str(error.value)


class DirectParameters(nn.Module):
    """Parameters used in the forward itself (``x + self.bias``, ``x @ self.w``), three deep."""

    def __init__(self, d=4, depth=3):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(depth))
        self.biases = nn.ParameterList(nn.Parameter(torch.randn(d)) for _ in range(depth))
        self.w = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        for fc, bias in zip(self.fcs, self.biases):
            x = torch.relu(fc(x) + bias)
        return x @ self.w


def test_a_parameter_read_in_forward_is_one_node():
    """Each parameter read is one get_attr node: computing a node's value with fx's getattr still
    patched gave the parameter as a new proxy, and every value computed from it added nodes again
    (a 4x4 nnScaler test module grew to ~20k nodes and took 14 s to trace)."""
    graphs = trace(DirectParameters(), {"x": torch.randn(2, 4)}).graphs
    for graph in graphs.values():
        ops = [n.op for n in graph.graph.nodes]
        assert ops.count("get_attr") == 4 and ops.count("call_module") == 3, ops
        assert len(ops) == 1 + 4 + 3 + 3 + 3 + 1 + 1, ops  # input, params, fcs, adds, relus, matmul, output
