"""Cases of tests/distributed/test_liger.py run on every rank: Liger's kernels inside nxd_hf's
layers (on the GPU lane), and its refusals where they cannot apply (everywhere)."""

import pytest
import torch
import transformers

import nxd_hf
from nxd_hf.model_setup.liger import apply_liger_kernels
from nxd_hf.parity.cases import gathered_grad

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
