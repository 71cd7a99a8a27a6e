"""Liger Kernel inside nxd_hf's layers (nxd_hf/model_setup/liger.py): its RMSNorm,
RoPE and SwiGLU kernels on the parallel layers on CUDA, its losses never (they are
full-vocabulary), and a clear ValueError wherever it cannot apply. The kernels themselves run on
the GPU lane only (Triton needs a GPU); the refusals run everywhere."""

import warnings

import pytest
import torch

import liger_cases
from nxd_hf.model_setup.liger import liger_options
from nxd_hf.testing import run_distributed


def test_options_keep_nxd_hf_loss():
    assert liger_options(None) == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                                   "fused_linear_cross_entropy": False}
    assert liger_options({"rope": False})["rope"] is False
    with pytest.warns(UserWarning, match="vocab-parallel"):
        assert liger_options({"fused_linear_cross_entropy": True})["fused_linear_cross_entropy"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        liger_options({"cross_entropy": False})
    with pytest.raises(ValueError, match="layer_norm"):
        liger_options({"layer_norm": True})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
@pytest.mark.parametrize("tp", [1, 2])
def test_refused_off_cuda(ranks2, tp):
    ranks2.run(liger_cases.refused_on_cpu, tp, model_parallel=(tp, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
def test_trainer_refuses_before_any_work(tmp_path):
    import nxd_hf

    args = nxd_hf.NxDTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, report_to=[])
    with pytest.raises(ValueError, match="Triton kernels for CUDA GPUs"):
        nxd_hf.NxDTrainer(liger_cases.tiny_llama(), args)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: `make test-gpu`")
def test_kernels_in_parallel_layers_match_hf(tp, monkeypatch):
    pytest.importorskip("liger_kernel")
    monkeypatch.setenv("NXD_HF_BACKEND", "cuda:gloo")  # two ranks on the one GPU (nccl refuses that)
    run_distributed(liger_cases.matches_hf_with_liger, tp, tp, timeout_s=600)
