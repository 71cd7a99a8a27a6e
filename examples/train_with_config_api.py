"""Train a tiny Llama with NxD's configuration API:

    torchrun --nproc_per_node 2 examples/train_with_config_api.py                 # dp 2
    torchrun --nproc_per_node 2 examples/train_with_config_api.py --tp 2 --bf16   # tp 2, bf16 + fp32 master weights
    torchrun --nproc_per_node 4 examples/train_with_config_api.py --pp 2 --zero1   # pp 2 x dp 2, ZeRO-1

neuronx_distributed_config -> initialize_parallel_model -> initialize_parallel_optimizer -> loop.
The data is random token windows of examples/data/tiny_corpus.txt (byte-level ids), so the
loss printed falls quickly.
"""

import argparse
import os

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state

CORPUS = os.path.join(os.path.dirname(__file__), "data", "tiny_corpus.txt")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero1", action="store_true", help="shard optimizer state over data-parallel ranks")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master weights and grads")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", default=None, help="resume from its newest checkpoint; save there")
    parser.add_argument("--save-every", type=int, default=10, help="steps between (asynchronous) checkpoints")
    return parser.parse_args()


def get_model(dtype: torch.dtype):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)  # the same initial weights on every rank
    return transformers.LlamaForCausalLM(config).to(dtype)


def main():
    args = parse_args()
    nxd_config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
        pipeline_config={"num_microbatches": 2} if args.pp > 1 else None,
        optimizer_config={"zero_one_enabled": args.zero1, "grad_clipping": True, "max_grad_norm": 1.0},
    )
    model = nxd_hf.initialize_parallel_model(nxd_config, get_model, torch.bfloat16 if args.bf16 else torch.float32)
    optimizer = nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=args.lr)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    stream = torch.tensor(list(open(CORPUS, "rb").read()))
    windows = torch.Generator().manual_seed(0)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        print(f"tp {args.tp} x pp {args.pp} x dp {dp_size}, zero1={args.zero1}, bf16={args.bf16}")
    losses, first_step = [], 0
    if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, "checkpoints.json")):
        # the optimizer exists before loading: its state is filled in place, as with NxD
        state = nxd_hf.load_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer)
        first_step = state["step"]
        windows.set_state(state["windows"])  # the data position travels in user_content
        if rank0:
            print(f"resumed from step {first_step}")
    for step in range(first_step, args.steps):
        starts = torch.randint(0, stream.numel() - args.seq_len, (args.batch_size,), generator=windows)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts]).chunk(dp_size)[dp_rank]
        batch = batch.to(backend.default_device())  # where the model was put (a GPU if any)
        loss = model.run_train(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if rank0 and (step % 5 == 0 or step in (first_step, args.steps - 1)):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        if args.checkpoint_dir and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            nxd_hf.save_checkpoint(args.checkpoint_dir, tag=f"step{step + 1}", model=model, optimizer=optimizer,
                                   user_content={"step": step + 1, "windows": windows.get_state()},
                                   num_kept_ckpts=2, async_save=True)  # destroy_model_parallel waits for it
    if rank0 and losses:
        print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    parallel_state.destroy_model_parallel()  # gloo's threads must not outlive the interpreter
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
