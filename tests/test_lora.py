"""LoRA through peft on parallel models (nxd_hf.lora): five AdamW steps equal plain peft on the
unsharded model, PEFT-format round trips, merge, bad input, and the peft internals we rely on."""

import inspect

import peft
import pytest
import transformers

import lora_cases
from nxd_hf.testing import run_distributed


def run_two_rank_cases(tmp_dir: str) -> None:
    lora_cases.check_training("llama", 2, target_modules=lora_cases.ALL_LLAMA)
    lora_cases.check_training("gpt2", 2, target_modules=["c_attn", "c_proj", "c_fc"])
    lora_cases.check_training("bert", 2, task_model_cls=transformers.BertForSequenceClassification, task="cls",
                              target_modules=["query", "key", "value", "dense"], modules_to_save=["classifier"])
    lora_cases.check_dropout_masks(2)


def run_four_rank_cases() -> None:
    lora_cases.check_training("llama", 4, target_modules=lora_cases.ALL_LLAMA)  # kv_heads 2 < tp 4: replicated K/V
    lora_cases.check_training("qwen2", 4, sp=True, target_modules=lora_cases.ALL_LLAMA)  # 6 heads padded to 8


def test_lora_two_ranks(tmp_path):
    run_distributed(run_two_rank_cases, 2, str(tmp_path))


def test_lora_four_ranks():
    run_distributed(run_four_rank_cases, 4)
