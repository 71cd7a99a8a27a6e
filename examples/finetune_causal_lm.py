"""Fine-tune a causal LM with nxd_hf.NxDTrainer: tensor, pipeline and data parallelism, ZeRO-1,
sequence parallelism, LoRA and bf16, on any local Hugging Face model directory and text file.

    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py                 # tiny bundled model, tp=2
    torchrun --nproc_per_node 4 examples/finetune_causal_lm.py --tp 2 --zero1  # tp 2 x dp 2, ZeRO-1
    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --pp 2          # pipeline, 2 stages
    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --lora          # LoRA adapters only
    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --model DIR --data FILE
    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --save_strategy steps --save_steps 20
    torchrun --nproc_per_node 2 examples/finetune_causal_lm.py --resume_from_checkpoint true  # newest one

Any other ``--flag value`` is a ``TrainingArguments`` / ``NxDTrainingArguments`` field
(``--learning_rate 1e-4``, ``--save_steps 20``, ...). The default model is the tiny Llama in
examples/data/tiny-llama (``examples/make_tiny_model.py`` rebuilds it) and the default text
examples/data/tiny_corpus.txt; the loss falls from about ln(vocab) = 5.7.
"""

import argparse
import math
import os

import torch
import transformers

import nxd_hf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(DATA, "tiny-llama"), help="local HF model directory")
    parser.add_argument("--data", default=os.path.join(DATA, "tiny_corpus.txt"), help="a text file to train on")
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: world size / pp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--zero1", action="store_true", help="shard optimizer state over data parallelism")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--output_dir", default="outputs/finetune_causal_lm")
    args, rest = parser.parse_known_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tp = args.tp or max(1, world_size // args.pp)
    defaults = ["--max_steps", "60", "--learning_rate", "3e-3", "--per_device_train_batch_size", "4",
                "--logging_steps", "10", "--save_strategy", "no", "--report_to", "none", "--warmup_steps", "5",
                "--weight_decay", "0.01", "--disable_tqdm", "true"]
    layout = ["--output_dir", args.output_dir, "--tensor_parallel_size", str(tp),
              "--pipeline_parallel_size", str(args.pp), "--zero_1", str(args.zero1),
              "--sequence_parallel", str(args.sp), "--bf16", str(args.bf16)]
    if args.pp > 1:
        layout += ["--num_microbatches", "2"]
    parser = transformers.HfArgumentParser(nxd_hf.NxDTrainingArguments)
    (training_args,) = parser.parse_args_into_dataclasses(args=[*defaults, *layout, *rest])
    return args, training_args


def text_blocks(tokenizer, path: str, seq_len: int) -> list[dict]:
    """The file as overlapping windows of ``seq_len`` tokens (labels = inputs: causal LM)."""
    ids = torch.tensor(tokenizer(open(path).read())["input_ids"])
    if len(ids) <= seq_len:
        raise ValueError(f"{path} has {len(ids)} tokens: it needs more than --seq_len {seq_len}")
    starts = range(0, len(ids) - seq_len, max(1, seq_len // 4))
    return [{"input_ids": ids[s : s + seq_len], "labels": ids[s : s + seq_len]} for s in starts]


def main():
    args, training_args = parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    blocks = text_blocks(tokenizer, args.data, args.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    transformers.set_seed(training_args.seed)  # the same LoRA adapters whatever the layout (and run to run)
    trainer = nxd_hf.NxDTrainer(model, training_args, train_dataset=blocks, eval_dataset=blocks[:8],
                                processing_class=tokenizer, peft_config=peft_config)
    resume = training_args.resume_from_checkpoint
    if resume == "true":  # the newest checkpoint-N in --output_dir
        resume = transformers.trainer_utils.get_last_checkpoint(args.output_dir)
    if resume and trainer.is_world_process_zero():
        print(f"resuming from {resume}")
    result = trainer.train(resume_from_checkpoint=resume)
    logged = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    losses = [loss for _, loss in logged] or [result.training_loss]  # fewer steps than --logging_steps
    start = logged[0][0] if logged else trainer.state.global_step
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(args.output_dir, "trainer_state.json"))  # the logs, full precision
        print(f"steps {start}..{trainer.state.global_step} on {nxd_hf.parallel_state.get_tensor_model_parallel_size()}"
              f" tp x {training_args.pipeline_parallel_size} pp x {nxd_hf.parallel_state.get_data_parallel_size()} dp; "
              f"ln(vocab) = {math.log(len(tokenizer)):.2f}; " + (f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}"
                                                       if len(losses) > 1 else f"loss {losses[0]:.4f}"))
        if args.lora:
            print(f"saved the adapter to {final_dir}: load it with "
                  f"peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({args.model!r}), {final_dir!r})")
        else:
            print(f"saved to {final_dir}: load it with transformers.AutoModelForCausalLM.from_pretrained({final_dir!r})")
    nxd_hf.parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
