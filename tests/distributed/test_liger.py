"""Liger Kernel inside nxd_hf's layers (nxd_hf/model_setup/liger.py): its RMSNorm,
RoPE and SwiGLU kernels on the parallel layers on CUDA, its losses never (they are
full-vocabulary), and a clear ValueError wherever it cannot apply. The kernels themselves run on
the GPU lane only (Triton needs a GPU); the refusals run everywhere."""

import warnings

import pytest
import torch
import transformers

import nxd_hf
from nxd_hf.model_setup.liger import apply_liger_kernels, liger_options
from nxd_hf.parity.cases import gathered_grad
from nxd_hf.testing import run_distributed


SEQ, BATCH = 16, 2


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def refused_on_cpu(tp: int) -> None:
    model = nxd_hf.parallelize(tiny_llama(), tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="Triton kernels for CUDA GPUs"):
        apply_liger_kernels(model)
    assert not any(m._get_name().startswith("Liger") for m in model.modules())


def matches_hf_with_liger(tp: int) -> None:
    """nxd_hf at ``tp`` with Liger's kernels against the unparallelized model with the same kernels
    (and against plain HF): loss and every gathered gradient, fp32."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    device = torch.device("cuda")
    reference = tiny_llama().to(device)
    plain = tiny_llama().to(device)
    _apply_liger_kernel_to_instance(model=reference, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    model = nxd_hf.parallelize(tiny_llama(), tensor_parallel_size=tp, sequence_parallel=tp > 1)
    apply_liger_kernels(model)
    names = {m._get_name() for m in model.modules()}
    assert {"LigerRMSNorm", "LigerSwiGLUMLP"} <= names, names
    ids = torch.randint(0, 101, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for m in (reference, plain, model):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-4, atol=1e-5)  # the kernels are exact in fp32
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(gathered_grad(param), reference_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


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
    ranks2.run(refused_on_cpu, tp, model_parallel=(tp, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off CUDA")
def test_trainer_refuses_before_any_work(tmp_path):
    import nxd_hf

    args = nxd_hf.NxDTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, report_to=[])
    with pytest.raises(ValueError, match="Triton kernels for CUDA GPUs"):
        nxd_hf.NxDTrainer(tiny_llama(), args)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: `make test-gpu`")
def test_kernels_in_parallel_layers_match_hf(tp, monkeypatch):
    pytest.importorskip("liger_kernel")
    monkeypatch.setenv("NXD_HF_BACKEND", "cuda:gloo")  # two ranks on the one GPU (nccl refuses that)
    run_distributed(matches_hf_with_liger, tp, tp, timeout_s=600)
