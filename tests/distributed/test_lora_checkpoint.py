"""NxD's LoRA checkpoint modes (issue 15, deliverable 4): save_checkpoint of a LoRA model from the
config API follows LoraConfig.save_lora_base / merge_lora / save_lora_config_adapter, and
load_lora_from_ckpt + load_checkpoint resume it (case bodies: tests/lora_ckpt_cases.py)."""

import lora_ckpt_cases
from nxd_hf.testing import run_distributed


def test_lora_checkpoint_modes_tp2(tmp_path):
    """tp=2 llama (all projections, lm_head in modules_to_save, bias="lora_only"): adapter only ->
    plain PeftModel.from_pretrained; base and adapter -> consolidate + transformers + peft;
    merged -> consolidate + transformers; each reloads through load_lora_from_ckpt with the saved
    logits, and with load_checkpoint's optimizer state the next step equals the uninterrupted run."""
    run_distributed(lora_ckpt_cases.run_cases, 2, str(tmp_path))
