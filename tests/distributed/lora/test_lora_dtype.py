"""LoRA adapters in peft's dtype: on a bf16 model, fp32 adapters by default and
bf16 ones with ``autocast_adapter_dtype=False``, through ``parallelize(lora_config=...)`` and
``peft.get_peft_model(parallelize(...))``, training as plain peft does (tp=2)."""

import copy

from support import lora
import peft
import pytest
import torch

import nxd_hf
from nxd_hf import parallel_state
from support import hf_parity


# bf16 base: the sharded matmuls sum their products in another order than the unsharded ones (and
# the row-parallel partial sums are rounded to bf16 before the all-reduce), so activations differ
# by a few bf16 ulps (2**-8 relative). Losses agree to ~1e-2; the fp32 adapters after AdamW steps
# of lr 1e-3 differ by at most a fraction of one step's size per step (Adam divides the gradient
# by its own magnitude, so a gradient's rounding moves the step by less than lr).
LOSS_TOL = dict(rtol=2e-2, atol=2e-2)
ADAPTER_TOL = dict(rtol=2e-2, atol=lora.STEPS * lora.LR)
PREFIX = "base_model.model."


def _adapters(model) -> dict:
    return {n.removeprefix(PREFIX): p for n, p in model.named_parameters() if "lora_" in n}


def _pair(path: str, autocast: bool):
    """(plain peft model, nxd_hf model with LoRA through ``path``), both bf16, tp=2."""
    parallel_state.destroy_model_parallel()
    config = lora.lora_config(target_modules=lora.ALL_LLAMA)
    reference, model = hf_parity.build_pair("llama")
    reference, model = reference.to(torch.bfloat16), model.to(torch.bfloat16)
    torch.manual_seed(lora.SEED)
    ref = peft.get_peft_model(reference, copy.deepcopy(config), autocast_adapter_dtype=autocast)
    torch.manual_seed(lora.SEED)
    if path == "parallelize":
        par = nxd_hf.parallelize(model, tensor_parallel_size=2, lora_config=copy.deepcopy(config),
                                 autocast_adapter_dtype=autocast)
    elif path == "get_peft_model":
        model = nxd_hf.parallelize(model, tensor_parallel_size=2)
        torch.manual_seed(lora.SEED)
        par = peft.get_peft_model(model, copy.deepcopy(config), autocast_adapter_dtype=autocast)
    else:
        raise AssertionError(path)
    return ref, par


def check_adapter_dtype_and_training(path: str, autocast: bool) -> None:
    """Adapter dtypes as plain peft's (fp32 on bf16 by default, bf16 with the opt-out), then
    three AdamW steps: losses and adapters equal within bf16 tolerance."""
    ref, par = _pair(path, autocast)
    ref_adapters, adapters = _adapters(ref), _adapters(par)
    assert adapters and set(adapters) == set(ref_adapters), sorted(set(adapters) ^ set(ref_adapters))
    want = torch.float32 if autocast else torch.bfloat16
    for name, param in adapters.items():
        assert param.dtype == ref_adapters[name].dtype == want, f"{path} {name}: {param.dtype}, peft: {ref_adapters[name].dtype}"
        assert param.requires_grad
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lora.LR)
    opt = torch.optim.AdamW([p for p in par.parameters() if p.requires_grad], lr=lora.LR)
    for step in range(3):
        ids, labels = hf_parity.batch(seed=20 + step)
        ref_loss = ref(input_ids=ids, labels=labels).loss
        loss = par(input_ids=ids, labels=labels).loss
        ref_loss.backward(), loss.backward()
        torch.testing.assert_close(loss.float(), ref_loss.float(), **LOSS_TOL, msg=lambda m: f"{path} step {step}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in adapters.items():
        torch.testing.assert_close(lora.logical(param).detach(), ref_adapters[name].detach(), **ADAPTER_TOL,
                                   msg=lambda m: f"{path} {name} after 3 steps: {m}")


def check_trainer_adapter_dtype(out_dir: str, autocast: bool) -> None:
    """``NxDTrainer(peft_config=...)`` on a bf16 model: the adapters' dtype as ``get_peft_model``'s."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    config = lora.lora_config(target_modules=lora.ALL_LLAMA)
    ref = peft.get_peft_model(reference.to(torch.bfloat16), copy.deepcopy(config), autocast_adapter_dtype=autocast)
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, tensor_parallel_size=2, report_to=[], bf16=True)
    trainer = nxd_hf.NxDTrainer(model.to(torch.bfloat16), args, peft_config=copy.deepcopy(config),
                                autocast_adapter_dtype=autocast)
    ref_dtypes = {n: p.dtype for n, p in _adapters(ref).items()}
    dtypes = {n: p.dtype for n, p in _adapters(trainer.model).items()}
    assert dtypes == ref_dtypes and set(dtypes.values()) == {torch.float32 if autocast else torch.bfloat16}


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32_adapters", "bf16_adapters"])
@pytest.mark.parametrize("path", ["parallelize", "get_peft_model"])
def test_lora_adapter_dtype_follows_peft_tp2(ranks2, path, autocast):
    ranks2.run(check_adapter_dtype_and_training, path, autocast)


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32_adapters", "bf16_adapters"])
def test_nxd_trainer_adapter_dtype_follows_peft_tp2(ranks2, tmp_path, autocast):
    ranks2.run(check_trainer_adapter_dtype, str(tmp_path), autocast)
