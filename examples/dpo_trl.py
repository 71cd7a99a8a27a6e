"""Direct preference optimization with TRL's DPOTrainer on nxd_hf (``pip install nxd_hf[trl]``):
``nxd_hf.NxDDPOTrainer`` / ``nxd_hf.NxDDPOConfig`` take every ``DPOConfig`` field plus the
parallel layout, in one ``HfArgumentParser`` dataclass.

    torchrun --nproc_per_node 2 examples/dpo_trl.py --tensor_parallel_size 2           # tp=2
    torchrun --nproc_per_node 2 examples/dpo_trl.py --tensor_parallel_size 2 --lora    # LoRA (peft_config)
    torchrun --nproc_per_node 2 examples/dpo_trl.py --zero_1 true                      # dp=2, ZeRO-1
    torchrun --nproc_per_node 2 examples/dpo_trl.py --pipeline_parallel_size 2 --num_microbatches 2  # pp=2

The data: a small preference set built here from examples/data/tiny_corpus.txt (a prompt of six
words; chosen: the corpus's next words; rejected: the same words shuffled). The model: the
bundled tiny random Llama (examples/data/tiny-llama, written by make_tiny_model.py with
save_pretrained) or ``--model DIR``. The reference model is a frozen copy of the model, sharded
like it (with ``--lora``: the model with its adapters disabled). Any other ``--flag value`` is an
``NxDDPOConfig`` field. It prints the first and last logged loss and reward margin, and saves the
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


def preferences(n: int, seed: int = 0) -> Dataset:
    """Prompt / chosen / rejected rows: the corpus's continuation is preferred to a shuffle of it."""
    words = open(os.path.join(DATA, "tiny_corpus.txt")).read().split()
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randrange(len(words) - 20)
        continuation = words[start + 6:start + 12]
        shuffled = rng.sample(continuation, len(continuation))
        rows.append({"prompt": " ".join(words[start:start + 6]), "chosen": " " + " ".join(continuation),
                     "rejected": " " + " ".join(shuffled)})
    return Dataset.from_list(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(DATA, "tiny-llama"), help="local HF model directory")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft_config)")
    args, rest = parser.parse_known_args()
    defaults = ["--output_dir", "outputs/dpo_trl", "--max_steps", "40", "--learning_rate", "1e-3",
                "--per_device_train_batch_size", "4", "--logging_steps", "5", "--eval_strategy", "steps",
                "--eval_steps", "20", "--save_strategy", "no", "--report_to", "none", "--max_length", "64",
                "--beta", "0.1", "--bf16", "false", "--gradient_checkpointing", "false", "--disable_tqdm", "true"]
    (config,) = transformers.HfArgumentParser(nxd_hf.NxDDPOConfig).parse_args_into_dataclasses([*defaults, *rest])
    peft_config = None
    if args.lora:
        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = nxd_hf.NxDDPOTrainer(
        transformers.AutoModelForCausalLM.from_pretrained(args.model), args=config, train_dataset=preferences(200),
        eval_dataset=preferences(16, seed=1), processing_class=transformers.AutoTokenizer.from_pretrained(args.model),
        peft_config=peft_config)
    trainer.train()
    trainer.save_model(os.path.join(config.output_dir, "final"))
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(config.output_dir, "trainer_state.json"))  # the logs, full precision
        logged = [h for h in trainer.state.log_history if "rewards/margins" in h]
        if logged:
            print(f"loss {logged[0]['loss']:.4f} -> {logged[-1]['loss']:.4f}; reward margin "
                  f"{logged[0]['rewards/margins']:.4f} -> {logged[-1]['rewards/margins']:.4f}")


if __name__ == "__main__":
    main()
