"""Sequence classification with nxd_hf.NxDTrainer: a BERT classifier at tp=2 with accuracy from
``compute_metrics``, evaluated as ``transformers.Trainer`` would.

    torchrun --nproc_per_node 2 examples/classify_bert.py           # tiny BERT built here, tp=2
    torchrun --nproc_per_node 2 examples/classify_bert.py --lora    # LoRA adapters + the classifier
    torchrun --nproc_per_node 2 examples/classify_bert.py --model DIR   # a local BERT checkpoint

The task: does a sentence of examples/data/tiny_corpus.txt mention the sea (sea, ship, water,
wave, shore, fog)? Any other ``--flag value`` is a ``TrainingArguments`` field.
"""

import argparse
import os
import re

import numpy as np
import torch
import transformers

import nxd_hf

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SEA = re.compile(r"\b(sea|ships?|water|waves?|shore|fog)\b", re.IGNORECASE)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local BERT directory (default: a tiny BERT built here)")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters and the classifier only")
    parser.add_argument("--output_dir", default="outputs/classify_bert")
    args, rest = parser.parse_known_args()
    defaults = ["--max_steps", "80", "--learning_rate", "2e-3", "--per_device_train_batch_size", "8",
                "--per_device_eval_batch_size", "16", "--logging_steps", "20", "--eval_strategy", "steps",
                "--eval_steps", "40", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
    parser = transformers.HfArgumentParser(nxd_hf.NxDTrainingArguments)
    (training_args,) = parser.parse_args_into_dataclasses(
        args=[*defaults, "--output_dir", args.output_dir, "--tensor_parallel_size", str(args.tp), *rest])
    return args, training_args


def sentences(tokenizer) -> list[dict]:
    text = open(os.path.join(DATA, "tiny_corpus.txt")).read()
    parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) > 3]
    encoded = tokenizer(parts, padding="max_length", truncation=True, max_length=48, return_tensors="pt")
    return [{"input_ids": encoded["input_ids"][i], "attention_mask": encoded["attention_mask"][i],
             "labels": torch.tensor(int(bool(SEA.search(s))))} for i, s in enumerate(parts)]


def accuracy(prediction) -> dict:
    logits, labels = prediction
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def build_model(args, tokenizer):
    if args.model:
        return transformers.AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                     num_labels=2, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)  # the same initial weights on every rank
    return transformers.BertForSequenceClassification(config)


def main():
    args, training_args = parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model or os.path.join(DATA, "tiny-llama"))
    data = sentences(tokenizer)
    model = build_model(args, tokenizer)
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"],
                                      modules_to_save=["classifier"], task_type="SEQ_CLS")
    trainer = nxd_hf.NxDTrainer(model, training_args, train_dataset=data, eval_dataset=data,
                                compute_metrics=accuracy, peft_config=peft_config)
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    if trainer.is_world_process_zero():
        print(f"{len(data)} sentences, {sum(int(d['labels']) for d in data)} about the sea; "
              f"accuracy on them went from {before:.3f} to {after:.3f}")
        loader = "peft.AutoPeftModelForSequenceClassification" if args.lora else \
            "transformers.AutoModelForSequenceClassification"
        print(f"saved to {final_dir}: load it with {loader}.from_pretrained({final_dir!r})")
    nxd_hf.parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
