"""What the TRL test files (SFT, DPO) share: their LoRA settings and trainer arguments."""

import peft

STEPS = 4


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def common(**overrides) -> dict:
    """Config fields of both runs of a parity case (plain and nxd_hf), ``overrides`` on top."""
    return {**dict(max_steps=STEPS, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=2,
                   save_strategy="no", report_to=[], seed=7, max_grad_norm=0.5, disable_tqdm=True, warmup_steps=1,
                   bf16=False, gradient_checkpointing=False, max_length=24, per_device_eval_batch_size=4,
                   dataset_num_proc=None), **overrides}


def global_eval_batch(overrides: dict, dp: int) -> dict:
    """``overrides`` for the plain run on one process: per_device_eval_batch_size counts rows per
    data-parallel replica (as the train batch), so one process evaluates all ``dp`` replicas' at once."""
    return {**overrides, "per_device_eval_batch_size": common(**overrides)["per_device_eval_batch_size"] * dp}
