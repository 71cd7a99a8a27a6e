"""The reference-fix table: NxD code that broke on nxd_hf runs now, one test per row (the world-2
bodies are in ``reference_fix_cases.py``, all run in one spawn)."""

import sys
import types

import pytest
import torch
import transformers

import hf_parity
import reference_fix_cases
from nxd_hf.testing import run_distributed

NAMES = [case.__name__ for case in reference_fix_cases.CASES]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fixes"))
    return run_distributed(reference_fix_cases.run_cases, 2, tmp, NAMES, timeout_s=600)


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
