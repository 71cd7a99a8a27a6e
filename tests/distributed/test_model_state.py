"""``model.nxd`` (``nxd_hf.model_state``) and the optimizer-state protocol
(``nxd_hf.checkpoint.optim_state``): what the setup sequence records, the pipeline wrapper's
public interface, both optimizers' per-parameter state out and back in at another layout, and
that ``checkpoint/`` and ``lora/`` reach models and optimizers only through these seams."""

import ast
import pathlib

import peft
import torch

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint.optim_state import MASTER, OptimizerState
from nxd_hf.model_state import NxDModelState, state_of
from nxd_hf.optim import NeuronZero1Optimizer, NxDOptimizer
from nxd_hf.testing import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[2] / "nxd_hf"
FORMER_ATTRIBUTES = {"_nxd_parallelized", "_nxd_patch", "nxd_grad_reduction", "nxd_adapters", "nxd_load_report",
                     "_nxd_input_check", "_nxd_disk_renamings", "_original"}


def _plain_tp2_with_lora():
    _, model = hf_parity.build_pair("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    returned = nxd_hf.parallelize(model, tensor_parallel_size=2, lora_config=lora)
    state = model.nxd
    assert returned is model and state_of(model) is state and isinstance(state, NxDModelState)
    assert (state.tp_size, state.pp_size, state.dp_size) == (2, 1, 1)
    assert state.wrapper == "plain" and not state.pipelined
    assert state.hf_model is model and state.local_modules == [model]
    assert state.patch.model_type == "llama" and state.head_layout is not None
    assert state.grad_reduction is not None and state.input_check is not None and state.adapters is not None
    assert not FORMER_ATTRIBUTES & set(vars(model)), FORMER_ATTRIBUTES & set(vars(model))
    try:
        nxd_hf.parallelize(model, tensor_parallel_size=2)
        raise AssertionError("parallelizing twice must fail")
    except ValueError as e:
        assert "already parallelized" in str(e)
    parallel_state.destroy_model_parallel()


def _pipeline_pp2():
    _, model = hf_parity.build_pair("llama")
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2)
    state = pp_model.nxd
    assert state is model.nxd and state.pipelined and state.pp_size == 2
    assert pp_model.hf_model is model and state.hf_model is model
    assert pp_model.local_modules() == list(pp_model.stages.values()) == state.local_modules
    assert state.grad_reduction is not None and state.adapters is None
    assert not FORMER_ATTRIBUTES & (set(vars(model)) | set(vars(pp_model)))
    parallel_state.destroy_model_parallel()


def _optimizer_protocol_dp2():
    """Both optimizers give each parameter's state in its own layout, and take it back at
    another layout: ZeRO-1's sharded state into NxDOptimizer and back."""
    _, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model)
    model = model.to(torch.bfloat16)
    ids, labels = hf_parity.batch(seed=1 + parallel_state.get_data_parallel_rank())
    zero1 = NeuronZero1Optimizer(list(model.parameters()), torch.optim.AdamW, lr=1e-2, model=model)
    plain = NxDOptimizer(list(model.parameters()), torch.optim.AdamW, max_grad_norm=None, use_master_weights=True,
                         lr=1e-2)
    for optimizer in (zero1, plain):
        assert isinstance(optimizer, OptimizerState)
    assert zero1.shards_state_over_dp and not plain.shards_state_over_dp
    model(input_ids=ids, labels=labels).loss.backward()
    zero1.step()
    states = zero1.param_states()
    assert set(states) == {id(p) for p in model.parameters()}
    for param, state in states.values():
        assert state["exp_avg"].shape == param.shape and state[MASTER].dtype == torch.float32
        assert state["step"].dim() == 0
    plain.load_param_states({k: s for k, (_, s) in states.items()})
    back = plain.param_states()
    zero1_again = NeuronZero1Optimizer(list(model.parameters()), torch.optim.AdamW, lr=1e-2)
    zero1_again.load_param_states({k: s for k, (_, s) in back.items()})
    for key, (param, state) in zero1_again.param_states().items():
        for name, value in state.items():
            torch.testing.assert_close(value, states[key][1][name], rtol=0, atol=0, msg=name)
    parallel_state.destroy_model_parallel()


def run_cases():
    _plain_tp2_with_lora()
    _pipeline_pp2()
    _optimizer_protocol_dp2()


def test_model_state_and_optimizer_protocol_world2():
    run_distributed(run_cases, 2)


def _reads(path: pathlib.Path) -> list[str]:
    """Former attributes and wrapper internals a module reads, and hasattr probes of a model or optimizer."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in FORMER_ATTRIBUTES | {"stages", "local_stage_ids"}:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name) and target.id in ("model", "optimizer"):
                found.append(f"{path.name}:{node.lineno} {node.func.id}({target.id}, ...)")
    return found


def test_checkpoint_and_lora_use_the_protocols():
    found = [f for package in ("checkpoint", "lora") for path in sorted((ROOT / package).glob("*.py"))
             for f in _reads(path)]
    assert not found, found
