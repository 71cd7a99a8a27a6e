"""The reference-fix table: NxD code that broke on nxd_hf runs now, one test per row (the world-2
all run in one spawn)."""

import copy
import os
import sys
import types
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear
from nxd_hf.parallel_layers.pad import gather_full_tensor
from nxd_hf.testing import run_distributed
from support import hf_parity
from support.reference_fixes import Block, run_named, TOL


def _fresh(tp: int = 1, pp: int = 1) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)


class DictNet(nn.Module):
    """A plain module whose forward returns a dict, the loss not first."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, features, labels):
        h = self.inp(features)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def case_dict_output_loss_value_spec(tmp: str) -> None:
    from nxd_hf.pipeline import NxDPPModel

    _fresh(1, 2)
    torch.manual_seed(0)
    reference = DictNet()
    model = copy.deepcopy(reference)
    pp_model = NxDPPModel(model, transformer_layer_cls=Block, num_microbatches=2, input_names=["features", "labels"],
                          output_loss_value_spec={"logits": False, "loss": True}, tracer_cls="torch",
                          auto_partition=True, broadcast_and_average_loss=True)
    g = torch.Generator().manual_seed(1)
    features, labels = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    loss = pp_model.run_train(features=features, labels=labels)
    ref_loss = reference(features, labels)["loss"]
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in pp_model.local_named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, **TOL)


def _llama_pp(**pp_kwargs):
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    return reference, nxd_hf.parallelize(model, pipeline_parallel_size=2, broadcast_and_average_loss=True, **pp_kwargs)


def case_positional_run_train(tmp: str) -> None:
    reference, pp_model = _llama_pp(num_microbatches=2)
    ids, labels = hf_parity.batch(b=4)
    mask = torch.ones_like(ids)
    ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(pp_model.run_train(ids, mask, labels), ref_loss.detach(), **TOL)  # input_names order
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    torch.testing.assert_close(pp_model.run_eval(batch), ref_loss.detach(), **TOL)  # one dict, as a tokenizer's
    # the config API's NxDModel without PP: one dict positionally
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2)
    model = nxd_hf.initialize_parallel_model(config, lambda: hf_parity.build_pair("llama", num_hidden_layers=4)[1])
    torch.testing.assert_close(model.run_train(batch), ref_loss.detach(), **TOL)


def case_num_microbatches_default(tmp: str) -> None:
    import nxd_hf.pipeline.nxd_inputs as nxd_inputs

    nxd_inputs._warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, pp_model = _llama_pp()
    assert pp_model.num_microbatches == 2, pp_model.num_microbatches
    assert any("num_microbatches not given" in str(w.message) for w in caught), [str(w.message) for w in caught]
    ids, labels = hf_parity.batch(b=4)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(pp_model.run_train(input_ids=ids, labels=labels), ref_loss.detach(), **TOL)
    # NxDTrainingArguments(pipeline_parallel_size=2) without --num_microbatches (run_clm.py's case)
    from nxd_hf import NxDTrainingArguments

    parallel_state.destroy_model_parallel()
    args = NxDTrainingArguments(output_dir=os.path.join(tmp, "args"), pipeline_parallel_size=2, report_to=[])
    model = nxd_hf.initialize_parallel_model(args.nxd_config(),
                                             lambda: hf_parity.build_pair("llama", num_hidden_layers=4)[1])
    torch.testing.assert_close(model.run_train(input_ids=ids, labels=labels), ref_loss.detach(), **TOL)


def case_gqa_head_dim_inferred(tmp: str) -> None:
    from nxd_hf.modules.qkv_linear import GQAQKVColumnParallelLinear

    _fresh(2, 1)
    torch.manual_seed(0)
    layer = GQAQKVColumnParallelLinear(16, [32, 8], bias=True, gather_output=True, kv_size_multiplier=2)
    assert layer.kv_shard_index.tolist() == list(range(8)), "NxD's layout: each rank holds a whole copy of K/V"
    weight, bias = gather_full_tensor(layer.weight_qkv), gather_full_tensor(layer.bias_qkv)  # [q; k; v]
    reference = nn.Linear(16, 48)
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=g)
    probe = torch.randn(2, 5, 48, generator=g)
    q, k, v = layer(x)
    torch.testing.assert_close(torch.cat([q, k, v], -1), reference(x).detach(), **TOL)
    (torch.cat([q, k, v], -1) * probe).sum().backward()
    (reference(x) * probe).sum().backward()
    torch.testing.assert_close(gather_full_tensor(layer.weight_qkv, layer.weight_qkv.grad), reference.weight.grad, **TOL)
    torch.testing.assert_close(gather_full_tensor(layer.bias_qkv, layer.bias_qkv.grad), reference.bias.grad, **TOL)


def _dp_half(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(parallel_state.get_data_parallel_size())[parallel_state.get_data_parallel_rank()]


def case_zero1_torch_xla_arguments(tmp: str) -> None:
    from nxd_hf.optim.zero1 import NeuronZero1Optimizer

    _fresh(1, 1)  # dp = 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    optimizer = NeuronZero1Optimizer(  # grad_clipping defaults to True, max_norm to 1.0 (torch-xla's)
        model.parameters(), torch.optim.AdamW, optimizer_dtype=torch.float32, pin_layout=False, lr=0.05,
        sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True))
    # gradients of 10 * x**2 on this small MLP are O(0.1-10), ~1e7 times eps: Adam's step does not
    # amplify their rounding (d step / d g ~ eps / g**2), so its parameters compare at TOL on any CPU
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        (10 * model(_dp_half(x)).square().sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        (10 * sum(reference(half).square().sum() for half in x.chunk(2)) / 2).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        assert ref_norm > 1.0, "the case must clip"
        torch.testing.assert_close(optimizer.grad_norm, ref_norm, **TOL)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, **TOL)
    # optimizer_dtype: float64 masters; grad_clipping=False: no clipping; lazy_init: sharded on init_zero()
    model64 = copy.deepcopy(reference)
    ref64 = copy.deepcopy(reference).double()
    optimizer = NeuronZero1Optimizer(model64.parameters(), torch.optim.SGD, optimizer_dtype=torch.float64,
                                     grad_clipping=False, lazy_init=True, lr=0.1)
    try:
        optimizer.step()
        raise AssertionError("step() before init_zero() with lazy_init=True must raise")
    except ValueError as error:
        assert "init_zero" in str(error)
    optimizer.init_zero()
    assert optimizer.masters[0].dtype == torch.float64
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    (10 * model64(_dp_half(x)).square().sum()).backward()
    optimizer.step()
    (10 * sum(ref64(half.double()).square().sum() for half in x.chunk(2)) / 2).backward()
    with torch.no_grad():
        for r in ref64.parameters():
            r -= 0.1 * r.grad  # no clipping although the norm is > 1
    for p, r in zip(model64.parameters(), ref64.parameters()):
        torch.testing.assert_close(p.double(), r, **TOL)


class HeadsAndMLP(nn.Module):
    """Attention-like projections of 3 heads of 8, and an MLP of width 20 (not head-shaped)."""

    def __init__(self):
        super().__init__()
        self.q = ColumnParallelLinear(24, 24, gather_output=False)
        self.o = RowParallelLinear(24, 24, input_is_parallel=True)
        self.up = ColumnParallelLinear(24, 20, gather_output=False)
        self.down = RowParallelLinear(20, 24, input_is_parallel=True)

    def forward(self, x):
        x = x + self.o(torch.relu(self.q(x)))
        return x + self.down(torch.relu(self.up(x)))


def case_pad_model_default_scope(tmp: str) -> None:
    from nxd_hf.parallel_layers.pad import pad_model

    _fresh(2, 1)
    torch.manual_seed(0)
    model = HeadsAndMLP()
    x = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(1))
    before = model(x).detach()
    pad_model(model, 2, 3)  # NxD's default wrapped_classes=()
    assert model.q.output_size_per_partition == 16, "3 heads of 8 padded to 4: 2 heads per rank"
    assert model.up.output_size_per_partition == 10, "the MLP is left as it is"
    torch.testing.assert_close(model(x), before, **TOL)


def _column_row(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(ColumnParallelLinear(8, 16, gather_output=False), RowParallelLinear(16, 8, input_is_parallel=True))


def case_parallel_layers_save_load(tmp: str) -> None:
    from nxd_hf import parallel_layers

    _fresh(2, 1)
    model = _column_row(0)
    path = os.path.join(tmp, "legacy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_layers.save({"epoch": 3, "model": model.state_dict()}, path)
    assert any(issubclass(w.category, FutureWarning) and "save_checkpoint" in str(w.message) for w in caught)
    tp = parallel_state.get_tensor_model_parallel_rank()
    assert os.path.isfile(os.path.join(path, f"tp_rank_{tp:02d}_pp_rank_00", "checkpoint.pt"))
    other = _column_row(1)
    checkpoint = parallel_layers.load(path, model=other)
    assert checkpoint["epoch"] == 3
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    # sharded=False: one unsharded file (as a one-process run saves it) into the sharded model
    full = {name: gather_full_tensor(p) if getattr(p, "tensor_model_parallel", False) else p.detach()
            for name, p in model.named_parameters()}
    if backend.rank() == 0:
        torch.save({"model": full}, os.path.join(tmp, "full.pt"))
    backend.barrier()
    third = _column_row(2)
    parallel_layers.load(os.path.join(tmp, "full.pt"), third, sharded=False)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(third(x), model(x), **TOL)


def case_lora_model(tmp: str) -> None:
    from nxd_hf.lora import LoRAModel, to_peft_config
    from nxd_hf.modules.lora import LoraConfig

    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    config = LoraConfig(enable_lora=True, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                        target_modules=["q_proj", "v_proj", "k_proj"], lora_verbose=False)
    ref = peft.get_peft_model(reference, to_peft_config(config))
    lora_model = LoRAModel(model, config)
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.named_parameters()}
    trainable = {n.removeprefix("module."): p for n, p in lora_model.named_parameters() if p.requires_grad}
    assert set(trainable) == {n for n, p in ref_params.items() if p.requires_grad}, sorted(trainable)
    with torch.no_grad():  # same adapters: A from the reference (column-parallel targets: A is replicated)
        for name, param in trainable.items():
            if "lora_A" in name:
                param.copy_(ref_params[name])
            else:
                ref_params[name].normal_(generator=torch.Generator().manual_seed(5))  # B != 0: A gets gradients
                param.copy_(ref_params[name].chunk(2)[parallel_state.get_tensor_model_parallel_rank()])
    ids, labels = hf_parity.batch()
    loss = lora_model(input_ids=ids, labels=labels).loss
    ref_loss = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    ref_loss.backward()
    for name, param in trainable.items():
        grad = gather_full_tensor(param, param.grad) if getattr(param, "tensor_model_parallel", False) else param.grad
        torch.testing.assert_close(grad, ref_params[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def case_dp_replicas_must_match(tmp: str) -> None:
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", seed=backend.rank())  # each rank its own random init
    try:
        nxd_hf.parallelize(model)  # tp=1: dp=2
        raise AssertionError("replicas with different weights were accepted")
    except ValueError as error:
        assert "data-parallel replicas hold different weights" in str(error), error
        assert "set_seed" in str(error)
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", seed=0)
    nxd_hf.parallelize(model)  # equal replicas pass


CASES = [case_dict_output_loss_value_spec, case_positional_run_train, case_num_microbatches_default,
         case_gqa_head_dim_inferred, case_zero1_torch_xla_arguments, case_pad_model_default_scope,
         case_parallel_layers_save_load, case_lora_model, case_dp_replicas_must_match]


def run_cases(tmp: str, names: list[str]) -> dict:
    return run_named(CASES, tmp, names)


NAMES = [case.__name__ for case in CASES]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fixes"))
    return run_distributed(run_cases, 2, tmp, NAMES, timeout_s=600)


@pytest.mark.parametrize("name", NAMES)
def test_row(world2, name):
    for rank, results in enumerate(world2):
        assert results[name] is None, f"rank {rank}:\n{results[name]}"


def test_1f1b_with_fewer_microbatches_than_stages_names_num_microbatches():
    from nxd_hf.pipeline.runtime import check_schedule

    with pytest.raises(ValueError, match="num_microbatches=2"):
        check_schedule("1f1b", 2, 1, 1)


def test_init_on_device_at_nxd_path():
    from nxd_hf.utils.model_utils import init_on_device

    config = transformers.LlamaConfig(**hf_parity.TINY["llama"][2])
    with init_on_device(torch.device("meta")):
        model = transformers.LlamaForCausalLM(config)
    assert all(p.is_meta for p in model.parameters())


def test_apply_checkpoint_sample_imports():
    from nxd_hf.parallel_layers.parallel_state import rmsg
    from nxd_hf.utils.logger import get_logger
    import nxd_hf.parallel_layers.parallel_state as nxd_path
    from nxd_hf import parallel_state

    assert nxd_path is parallel_state and callable(rmsg)
    get_logger().warning(rmsg("the sample's logger works"))


def test_torchdistx_deferred_init_is_refused(monkeypatch):
    """torchdistx does not install on torch 2.x; its ``torchdistx.fake.is_fake`` is stood in for
    by a module that marks the tensors a deferred_init would have made fake."""
    import nxd_hf

    fake = types.ModuleType("torchdistx.fake")
    fake.is_fake = lambda t: getattr(t, "_fake_for_test", False)
    monkeypatch.setitem(sys.modules, "torchdistx", types.ModuleType("torchdistx"))
    monkeypatch.setitem(sys.modules, "torchdistx.fake", fake)
    _, model = hf_parity.build_pair("llama")
    for p in model.parameters():
        p._fake_for_test = True
    with pytest.raises(ValueError, match=r"deferred_init.*init_on_device\(torch.device\('meta'\)\).*param_init_fn"):
        nxd_hf.parallelize(model)
