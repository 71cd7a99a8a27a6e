"""nnScaler's ``ComputeConfig`` and the PAS policies, in-process: the checks that need no ranks
(inconsistent sizes, unknown or unavailable policies, pipeline without end2end, a user policy's
inexact layout), and ``parallelize(..., load_module=False)``, which only plans and saves."""

import json

import pytest
import torch

from support import nnscaler_models as cases
from nxd_hf.nnscaler import ComputeConfig, Plan, parallelize
from nxd_hf.fx_tp.derive import derive_layouts, trace


def test_compute_config_fields_and_units():
    config = ComputeConfig(2, 8, use_zero=True, use_end2end=True, pas_config={"pipeline_nmicros": 4})
    assert (config.plan_ngpus, config.runtime_ngpus, config.units, config.use_zero) == (2, 8, 4, True)
    assert ComputeConfig(plan_ngpus=1, runtime_ngpus=1) == ComputeConfig(1, 1)


@pytest.mark.parametrize("kwargs, words", [
    (dict(plan_ngpus=3, runtime_ngpus=4), "not a multiple"),
    (dict(plan_ngpus=0, runtime_ngpus=4), "positive int"),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=0), "positive"),
    (dict(plan_ngpus=1, runtime_ngpus=1, pas_config={"pipeline_scheduler": "zb"}), "1f1b"),
    (dict(plan_ngpus=1, runtime_ngpus=1, no_such_field=1), "unknown fields"),
])
def test_compute_config_refuses_inconsistent_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ComputeConfig(**kwargs)


def test_ignored_fields_warn():
    with pytest.warns(UserWarning, match="zero_ngroups=2 is ignored"):
        ComputeConfig(1, 2, zero_ngroups=2)


@pytest.mark.parametrize("policy, config, words", [
    ("autodist", ComputeConfig(2, 2), "Hugging Face model's config"),
    ("dp", ComputeConfig(2, 2), "plan_ngpus=1"),
    ("pp", ComputeConfig(2, 2), "use_end2end=True"),
    ("hybrid", ComputeConfig(4, 4), "use_end2end=True"),
    ("magic", ComputeConfig(2, 2), "not a builtin"),
    (lambda graph, config: Plan(tp_size=4), ComputeConfig(2, 2), "plan_ngpus=2"),
    (lambda graph, config: {"embed": "vocab"}, ComputeConfig(2, 2), "must return an nxd_hf.nnscaler.Plan"),
    (lambda graph, config: Plan(tp_size=2, layouts={"layers.0.mlp.down": "row"}), ComputeConfig(2, 2), "not exact"),
    (lambda graph, config: Plan(tp_size=2, layouts={"nowhere": "column"}), ComputeConfig(2, 2), "does not call"),
])
def test_policy_errors(tmp_path, policy, config, words):
    with pytest.raises(ValueError, match=words):
        parallelize(cases.LLM(), {"x": torch.randint(0, 32, (2, 8))}, policy, config, gen_savedir=tmp_path,
                    load_module=False)


def test_autodist_picks_a_unit_layout_by_the_plan_search(tmp_path):
    """pas_policy='autodist' on an HF model: nxd_hf.plan's best layout with plan_ngpus ranks per unit."""
    import os

    import transformers

    tiny = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "tiny-llama")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tiny))
    assert parallelize(model, {"input_ids": torch.randint(0, 32, (2, 16))}, "autodist", ComputeConfig(2, 4),
                       gen_savedir=tmp_path, instance_name="auto", load_module=False) is None
    saved = json.loads((tmp_path / "auto" / "plan.json").read_text())["plan"]
    assert saved["tp_size"] * saved["pp_size"] == 2 and saved["pp_size"] == 1  # no end2end: no pipeline


def test_load_module_false_plans_and_saves(tmp_path):
    assert parallelize(cases.LLM, {"x": torch.randint(0, 32, (2, 8))}, "tp", ComputeConfig(2, 4),
                       gen_savedir=tmp_path, instance_name="llm", load_module=False) is None
    saved = json.loads((tmp_path / "llm" / "plan.json").read_text())
    assert saved["plan"]["tp_size"] == 2 and saved["plan"]["layouts"]["layers.0.attn.o"] == "row"
    assert saved["compute_config"]["runtime_ngpus"] == 4


def test_derived_layout_is_exact_only():
    """A linear feeding a norm, the head (its output leaves the module), a reshape mixing the
    split dim, and a linear feeding two others in different ways stay replicated."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.c, self.d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.e, self.f = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            x = self.b(torch.relu(self.a(x)))          # column -> row
            x = self.norm(self.c(x))                    # a norm over the split dim: replicated
            y = self.e(x).sum(-1, keepdim=True)         # a reduction over the split dim: replicated
            return self.d(x) + self.f(x * y)            # d, f: outputs leave the module

    graph = trace(Net(), {"x": torch.randn(2, 8)})
    assert derive_layouts(graph, 2) == {"a": "column", "b": "row"}


def test_attention_split_by_heads_only_when_tp_divides_them():
    """q/k/v of 3 heads x 4 have 12 outputs, which 2 divides, but 3 heads do not split in 2:
    replicated; 4 heads are split (GQA's 2 K/V heads too)."""
    x = torch.randn(2, 8, 12)
    assert derive_layouts(trace(cases.Attention(12, 3, 3), {"x": x}), 2) == {}
    layouts = derive_layouts(trace(cases.Attention(16, 4, 2), {"x": torch.randn(2, 8, 16)}), 2)
    assert layouts == {"q": "column", "k": "column", "v": "column", "o": "row"}
    assert derive_layouts(trace(cases.Attention(16, 4, 2), {"x": torch.randn(2, 8, 16)}), 4) == {}  # 2 K/V heads


def test_ignored_arguments_warn(tmp_path):
    x = {"x": torch.randint(0, 32, (2, 8))}
    with pytest.warns(UserWarning, match="module_fn is ignored"):
        parallelize(cases.LLM(), x, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, module_fn=cases.LLM,
                    load_module=False)
    with pytest.warns(UserWarning, match="init_module_params is ignored"):
        parallelize(cases.LLM, x, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, init_module_params=False,
                    load_module=False)


def test_a_module_holding_a_parallel_module_is_refused(tmp_path):
    """nnScaler's "Parallel modules can not be nested": planning a parallel part again would shard
    its shards. The error is a ValueError and, for code written against nnScaler, a RuntimeError."""
    inner = parallelize(torch.nn.Linear(3, 5), {"input": torch.ones(2, 3)}, "dp", ComputeConfig(1, 1),
                        gen_savedir=tmp_path, instance_name="inner")
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="can not be nested: Sequential.0 is parallel already"):
            parallelize(outer, {"input": torch.ones(2, 3)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                        instance_name="outer")


def test_original_parameter_order_counts_a_shared_parameter_once():
    """The merged optimizer state is indexed by the original module's parameters() order, where a
    parameter shared by two submodules appears once (under its first name)."""
    from nxd_hf.nnscaler.state_layout import original_param_names

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[1].weight = model[0].weight
    assert original_param_names(model) == [name for name, _ in model.named_parameters()]
