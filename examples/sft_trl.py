"""Supervised fine-tuning with TRL's SFTTrainer on nxd_hf (``pip install nxd_hf[trl]``):
``nxd_hf.NxDSFTTrainer`` / ``nxd_hf.NxDSFTConfig`` take every ``SFTConfig`` field plus the
parallel layout, in one ``HfArgumentParser`` dataclass.

    torchrun --nproc_per_node 2 examples/sft_trl.py --tensor_parallel_size 2           # tp=2
    torchrun --nproc_per_node 2 examples/sft_trl.py --tensor_parallel_size 2 --lora    # LoRA (peft_config)
    torchrun --nproc_per_node 2 examples/sft_trl.py --pipeline_parallel_size 2 --num_microbatches 2
    torchrun --nproc_per_node 2 examples/sft_trl.py --zero_1 true                      # dp=2, ZeRO-1
    torchrun --nproc_per_node 2 examples/sft_trl.py --tensor_parallel_size 2 --assistant_only_loss true

The data: conversations built from examples/data/tiny_corpus.txt, formatted by the chat template
of the bundled tiny model (examples/data/tiny-llama); any other ``--flag value`` is an
``NxDSFTConfig`` field. It prints the first and last logged loss, the SFT metrics, and saves the
model (or, with ``--lora``, the adapter) to ``<output_dir>/final``.
"""

import argparse
import os
import random

import peft
import transformers
from datasets import Dataset

import nxd_hf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def conversations(n: int, seed: int = 0) -> Dataset:
    """A user line, then the assistant continuing it with the corpus's next words."""
    words = open(os.path.join(DATA, "tiny_corpus.txt")).read().split()
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randrange(len(words) - 20)
        rows.append({"messages": [{"role": "user", "content": " ".join(words[start:start + 6])},
                                  {"role": "assistant", "content": " ".join(words[start + 6:start + 14])}]})
    return Dataset.from_list(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(DATA, "tiny-llama"), help="local HF model directory")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft_config)")
    args, rest = parser.parse_known_args()
    defaults = ["--output_dir", "outputs/sft_trl", "--max_steps", "40", "--learning_rate", "3e-3",
                "--per_device_train_batch_size", "4", "--logging_steps", "10", "--eval_strategy", "steps",
                "--eval_steps", "20", "--save_strategy", "no", "--report_to", "none", "--max_length", "64",
                "--bf16", "false", "--gradient_checkpointing", "false", "--disable_tqdm", "true"]
    (config,) = transformers.HfArgumentParser(nxd_hf.NxDSFTConfig).parse_args_into_dataclasses([*defaults, *rest])
    peft_config = None
    if args.lora:
        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = nxd_hf.NxDSFTTrainer(
        transformers.AutoModelForCausalLM.from_pretrained(args.model), config, train_dataset=conversations(200),
        eval_dataset=conversations(16, seed=1), processing_class=transformers.AutoTokenizer.from_pretrained(args.model),
        peft_config=peft_config)
    result = trainer.train()
    trainer.save_model(os.path.join(config.output_dir, "final"))
    logged = [h for h in trainer.state.log_history if "mean_token_accuracy" in h]
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(config.output_dir, "trainer_state.json"))  # the logs, full precision
    if trainer.is_world_process_zero() and not logged:  # fewer steps than --logging_steps
        print(f"{trainer.state.global_step} steps, train loss {result.training_loss:.4f}")
    elif trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        last = logged[-1]
        print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}; entropy {last['entropy']:.4f}, "
              f"mean_token_accuracy {last['mean_token_accuracy']:.4f}, num_tokens {last['num_tokens']:.0f}")


if __name__ == "__main__":
    main()
