"""A reward model with TRL's RewardTrainer on nxd_hf (``pip install nxd_hf[trl]``):
``nxd_hf.NxDRewardTrainer`` / ``nxd_hf.NxDRewardConfig`` take every ``RewardConfig`` field plus the
parallel layout, in one ``HfArgumentParser`` dataclass.

    torchrun --nproc_per_node 2 examples/reward_trl.py --tensor_parallel_size 2 --lora   # LoRA (peft_config)
    torchrun --nproc_per_node 2 examples/reward_trl.py --zero_1 true                     # dp=2, ZeRO-1

The data: the preference set of dpo_trl.py (the corpus's continuation of a prompt preferred to a
shuffle of it). The model: the bundled tiny random Llama given by its directory, as TRL's reward
script gives it (loaded as a sequence classifier with one label, its head drawn after seeding),
or ``--model DIR``. With ``--lora`` the adapters train with the head (``task_type="SEQ_CLS"``, as
peft's task model). Any other ``--flag value`` is an ``NxDRewardConfig`` field. It prints the
first and last logged loss and accuracy, and saves the model (or, with ``--lora``, the adapter)
to ``<output_dir>/final``.
"""

import argparse
import os

import peft
import transformers

import nxd_hf
from dpo_trl import DATA, preferences


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(DATA, "tiny-llama"), help="local HF model directory")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters and the head (peft_config)")
    args, rest = parser.parse_known_args()
    defaults = ["--output_dir", "outputs/reward_trl", "--max_steps", "40", "--learning_rate", "1e-3",
                "--per_device_train_batch_size", "4", "--logging_steps", "5", "--eval_strategy", "steps",
                "--eval_steps", "20", "--save_strategy", "no", "--report_to", "none", "--max_length", "64",
                "--bf16", "false", "--gradient_checkpointing", "false", "--disable_tqdm", "true"]
    (config,) = transformers.HfArgumentParser(nxd_hf.NxDRewardConfig).parse_args_into_dataclasses([*defaults, *rest])
    peft_config = None
    if args.lora:
        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    trainer = nxd_hf.NxDRewardTrainer(
        args.model, args=config, train_dataset=preferences(200), eval_dataset=preferences(16, seed=1),
        processing_class=transformers.AutoTokenizer.from_pretrained(args.model), peft_config=peft_config)
    trainer.train()
    trainer.save_model(os.path.join(config.output_dir, "final"))
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(config.output_dir, "trainer_state.json"))  # the logs, full precision
        logged = [h for h in trainer.state.log_history if "accuracy" in h]
        if logged:
            print(f"loss {logged[0]['loss']:.4f} -> {logged[-1]['loss']:.4f}; accuracy "
                  f"{logged[0]['accuracy']:.3f} -> {logged[-1]['accuracy']:.3f}")


if __name__ == "__main__":
    main()
