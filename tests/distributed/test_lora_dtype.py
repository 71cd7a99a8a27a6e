"""LoRA adapters in peft's dtype: on a bf16 model, fp32 adapters by default and
bf16 ones with ``autocast_adapter_dtype=False``, through ``parallelize(lora_config=...)`` and
``peft.get_peft_model(parallelize(...))``, training as plain peft does (tp=2)."""

import pytest

import lora_dtype_cases


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32_adapters", "bf16_adapters"])
@pytest.mark.parametrize("path", ["parallelize", "get_peft_model"])
def test_lora_adapter_dtype_follows_peft_tp2(ranks2, path, autocast):
    ranks2.run(lora_dtype_cases.check_adapter_dtype_and_training, path, autocast)


@pytest.mark.parametrize("autocast", [True, False], ids=["fp32_adapters", "bf16_adapters"])
def test_nxd_trainer_adapter_dtype_follows_peft_tp2(ranks2, tmp_path, autocast):
    ranks2.run(lora_dtype_cases.check_trainer_adapter_dtype, str(tmp_path), autocast)
