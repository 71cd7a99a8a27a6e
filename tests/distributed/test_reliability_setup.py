"""Setup mistakes that used to hang, train silently wrong or fail inside torch: ranks
calling ``parallelize`` with different sizes, options or models; a rank failing alone in the
middle of setup; a K/V replication factor that is not one; non-LoRA peft methods on a parallel
model; empty batches and sequences. Each is one ValueError, the same on every rank; the cases
share one spawn of 2 ranks."""


import peft
import pytest
import torch

from support import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.heads import head_layout
from nxd_hf.testing import run_distributed
from support.errors import assert_same_error_on_every_rank


def _error(fn, *args, **kwargs) -> str:
    if fn is nxd_hf.parallelize:
        parallel_state.destroy_model_parallel()
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


def _model(**overrides):
    return hf_parity.build_pair("llama", **overrides)[1]


def _load_fails_on_rank1(modules):
    if backend.rank() == 1:
        raise RuntimeError("cannot allocate 3 GB on this device")


def _parallel():
    parallel_state.destroy_model_parallel()
    return nxd_hf.parallelize(_model(), tensor_parallel_size=2)


def setup_cases():
    rank, out = backend.rank(), {}
    out["tp"] = _error(nxd_hf.parallelize, _model(), tensor_parallel_size=2 - rank)
    out["sp"] = _error(nxd_hf.parallelize, _model(), tensor_parallel_size=2, sequence_parallel=rank == 1)
    out["model"] = _error(nxd_hf.parallelize, _model(num_hidden_layers=2 + rank), tensor_parallel_size=2)
    out["mid_setup"] = _error(nxd_hf.parallelize, _model(), tensor_parallel_size=2, load_weights=_load_fails_on_rank1)
    out["kv"] = _error(nxd_hf.parallelize, _model(), tensor_parallel_size=2, kv_size_multiplier=3)
    configs = {
        "prefix": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prompt": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "ia3": peft.IA3Config(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj", "down_proj"],
                              feedforward_modules=["down_proj"]),
    }
    for name, config in configs.items():
        model = _parallel()
        out[name] = _error(peft.get_peft_model, model, config)
    out["ia3_inject"] = _error(peft.inject_adapter_in_model, configs["ia3"], _parallel())
    model = _parallel()
    out["empty_batch"] = _error(model, input_ids=torch.zeros(0, 8, dtype=torch.long))
    out["empty_sequence"] = _error(model, input_ids=torch.zeros(2, 0, dtype=torch.long))
    ids, labels = hf_parity.batch()
    out["still_works"] = float(model(input_ids=ids, labels=labels).loss)
    out["later_steps"] = _different_batches_after_first_step()
    return out


def _different_batches_after_first_step():
    """TP ranks given the same first batch, then different ones (a sampler not split by DP rank)."""
    model = _parallel()
    with torch.no_grad():
        for call in range(4):
            ids, _ = hf_parity.batch(seed=1 if call == 0 else 100 * call + backend.rank())
            try:
                model(input_ids=ids)
            except ValueError as error:
                return call, str(error)
    return None, "no error"


@pytest.fixture(scope="module")
def results():
    return run_distributed(setup_cases, 2)


@pytest.mark.parametrize("case, pattern", [
    ("tp", r"different arguments on different ranks: tensor_parallel_size: rank 0: 2, rank 1: 1"),
    ("sp", r"sequence_parallel: rank 0: False, rank 1: True"),
    ("model", r"the model config \(keys \['num_hidden_layers'\]\) differs across ranks"),
    ("mid_setup", r"failed on rank 1 .*RuntimeError: cannot allocate 3 GB on this device"),
    ("kv", r"kv_size_multiplier=3 is not a valid K/V replication factor .*Use one of \[1, 2\]"),
    ("prefix", r"peft method PREFIX_TUNING is not supported on an nxd_hf parallel model.*Refused: .*IA3"),
    ("prompt", r"PROMPT_TUNING is not supported"),
    ("ia3", r"IA3 is not supported"),
    ("ia3_inject", r"IA3 is not supported"),
    ("empty_batch", r"empty batch \(no rows\): input_ids has shape \[0, 8\]"),
    ("empty_sequence", r"empty sequence \(no tokens\): input_ids has shape \[2, 0\]"),
])
def test_same_value_error_on_every_rank(results, case, pattern):
    assert_same_error_on_every_rank(results, case, pattern)


def test_different_batches_after_the_first_step_are_caught(results):
    """Caught on both ranks at the forward after the first different one (call 1): the default
    check compares an asynchronous fingerprint of every forward's inputs one step later."""
    assert results[0]["later_steps"] == results[1]["later_steps"]
    call, message = results[0]["later_steps"]
    assert call == 2 and "got different inputs" in message, (call, message)


def test_model_still_trains_after_the_errors(results):
    assert results[0]["still_works"] == results[1]["still_works"] > 0


@pytest.mark.parametrize("kv_heads, tp, m", [(2, 2, 3), (2, 4, 6), (4, 4, 3), (2, 8, 12)])
def test_kv_size_multiplier_not_a_replication_factor(kv_heads, tp, m):
    with pytest.raises(ValueError, match=f"kv_size_multiplier={m} is not a valid K/V replication factor"):
        head_layout(kv_heads * 4, kv_heads, 8, 0, tp, kv_size_multiplier=m)


@pytest.mark.parametrize("kv_heads, tp, m", [(2, 2, 1), (2, 2, 2), (2, 4, 2), (1, 4, 4), (2, 8, 8), (1, 4, 8), (1, 2, 4)])
# a multiple of tp: NxD's GQAQKVColumnParallelLinear is used with kv_size_multiplier=tp multiples
def test_kv_size_multiplier_valid_factors_accepted(kv_heads, tp, m):
    assert head_layout(kv_heads * 4, kv_heads, 8, 0, tp, kv_size_multiplier=m).kv_size_multiplier == m
