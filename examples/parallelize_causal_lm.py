"""Fine-tune a causal LM with nxd_hf tensor (and data) parallelism.

    torchrun --nproc_per_node 2 examples/parallelize_causal_lm.py            # tiny bundled default
    torchrun --nproc_per_node 4 examples/parallelize_causal_lm.py --tp 2     # tp 2 x dp 2
    torchrun --nproc_per_node 2 examples/parallelize_causal_lm.py --model DIR  # any local HF checkpoint

A bare training loop on ``nxd_hf.parallelize`` (``finetune_causal_lm.py`` does the same with
``NxDTrainer``). Without --model it uses the bundled tokenizer (examples/data/tiny-llama, trained
on examples/data/tiny_corpus.txt) and trains a tiny Llama from scratch; the loss printed falls
from about ln(vocab) within a few dozen steps.
"""

import argparse
import math
import os

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers import clip_grad_norm
from nxd_hf.parallel_layers.random import model_parallel_manual_seed

CORPUS = os.path.join(os.path.dirname(__file__), "data", "tiny_corpus.txt")
TOKENIZER = os.path.join(os.path.dirname(__file__), "data", "tiny-llama")  # byte-level BPE on the corpus


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF checkpoint directory (default: a tiny Llama built here)")
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: all ranks)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(args, tokenizer, tp: int):
    if args.model:
        model = nxd_hf.from_pretrained(args.model, tensor_parallel_size=tp, sequence_parallel=args.sequence_parallel)
        return model.train()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = transformers.LlamaForCausalLM(config)
    return nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=args.sequence_parallel)


def main():
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tp = args.tp or world_size
    text = open(CORPUS).read()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model or TOKENIZER)
    model = build_model(args, tokenizer, tp)
    model_parallel_manual_seed(args.seed)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    if args.batch_size % dp_size:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the data-parallel size {dp_size}")
    stream = torch.tensor(tokenizer(text)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    windows = torch.Generator().manual_seed(args.seed)  # same windows on every rank
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        print(f"world {world_size}: tp {tp} x dp {dp_size} on {backend.default_device()}, vocab {len(tokenizer)}, "
              f"{stream.numel()} tokens, "
              f"ln(vocab) = {math.log(len(tokenizer)):.2f}")
    first = last = None
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - args.seq_len, (args.batch_size,), generator=windows)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts]).chunk(dp_size)[dp_rank]
        batch = batch.to(backend.default_device())  # where parallelize put the model (a GPU if any)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()  # the post-backward hook averages gradients over data-parallel ranks
        clip_grad_norm(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss, group=parallel_state.get_data_parallel_group())
        mean_loss = mean_loss.item() / dp_size
        first = mean_loss if first is None else first
        last = mean_loss
        if rank0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean_loss:.4f}", flush=True)
    if rank0:
        print(f"loss fell from {first:.4f} to {last:.4f}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
