"""nxd_hf.lightning's argument checks (no processes): what NxD's classes refuse or ignore."""

import warnings

import pytest
import torch

from nxd_hf.lightning import NeuronLTModule, NeuronXLAPrecisionPlugin, NeuronXLAStrategy, NxDStrategy


def test_manual_optimization_only():
    with pytest.raises(ValueError, match="manual_opt=True"):
        NeuronLTModule(object, None, torch.optim.AdamW, None, manual_opt=False)
    assert NeuronLTModule(object, None, torch.optim.AdamW, None).automatic_optimization is False


def test_optimizer_options_by_name_and_accumulation_checked():
    with pytest.raises(ValueError, match="opt_kwargs"):
        NeuronLTModule(object, None, torch.optim.AdamW, None, opt_args=(1e-3,))
    with pytest.raises(ValueError, match="grad_accum_steps"):
        NeuronLTModule(object, None, torch.optim.AdamW, None, grad_accum_steps=0)


def test_strategy_alias_and_xser_warning():
    assert NeuronXLAStrategy is NxDStrategy
    with pytest.warns(UserWarning, match="save_load_xser is ignored"):
        NxDStrategy(tensor_parallel_size=2, save_load_xser=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NxDStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError):
        NxDStrategy(tensor_parallel_size=0)


def test_precision_plugin_choices():
    with pytest.raises(ValueError, match="bf16-mixed"):
        NeuronXLAPrecisionPlugin("16-mixed")
    with NeuronXLAPrecisionPlugin().forward_context():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with NeuronXLAPrecisionPlugin("32-true").forward_context():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32


def test_checkpoint_progress_names_what_is_missing(tmp_path):
    from nxd_hf.lightning import checkpoint_progress

    with pytest.raises(ValueError, match="not a Lightning checkpoint saved by NxDStrategy"):
        checkpoint_progress(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").mkdir()
    torch.save({"global_step": 12, "epoch": 1, "loops": {}}, tmp_path / "last.ckpt" / "lightning_state.pt")
    assert checkpoint_progress(tmp_path / "last.ckpt") == {"global_step": 12, "epoch": 1}


def test_flavor_follows_the_environment_then_the_program_then_what_is_installed():
    from nxd_hf.lightning.flavor import FLAVOR, choose_flavor, pl

    both = {"pytorch_lightning", "lightning"}
    assert choose_flavor("lightning", {"pytorch_lightning"}, both) == "lightning"
    assert choose_flavor(None, {"lightning"}, both) == "lightning"  # `import lightning as L` came first
    assert choose_flavor(None, {"pytorch_lightning"}, both) == "pytorch_lightning"
    assert choose_flavor(None, both, both) == "pytorch_lightning"
    assert choose_flavor(None, set(), {"lightning"}) == "lightning"
    with pytest.raises(ValueError, match="use 'pytorch_lightning' or 'lightning'"):
        choose_flavor("lightning.pytorch", set(), both)
    with pytest.raises(ValueError, match="not installed: pip install lightning"):
        choose_flavor("lightning", set(), {"pytorch_lightning"})
    with pytest.raises(ImportError, match=r"pip install nxd_hf\[lightning\]"):
        choose_flavor(None, set(), set())
    # here both are installed and neither was imported before nxd_hf.lightning
    assert FLAVOR == "pytorch_lightning" and pl.__name__ == "pytorch_lightning"
    assert issubclass(NxDStrategy, pl.strategies.ParallelStrategy)
