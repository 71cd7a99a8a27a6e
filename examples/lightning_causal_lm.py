"""Fine-tune the bundled tiny Llama with PyTorch Lightning on nxd_hf (pip install nxd_hf[lightning]):

    torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --tp 2
    torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --pp 2
    torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --zero1              # dp 2, ZeRO-1
    torchrun --nproc_per_node 2 examples/lightning_causal_lm.py --zero1 --resume lightning_out/last.ckpt

--max-steps counts the steps this run trains: a resumed run goes on from the checkpoint's step
(any layout) for that many more, the LR schedule's state coming from the checkpoint (past its end,
the final LR).

NeuronLTModule builds the model and optimizer through nxd_hf's training API; NxDStrategy sets up
the parallel layout and hands each data-parallel replica its share of the batches; one rank (the
last pipeline stage) shows the progress bar and writes TensorBoard logs to OUT/tb; the Lightning
checkpoint OUT/last.ckpt is an nxd_hf checkpoint directory, loadable at other parallel sizes.
"""

import argparse
import os

import pytorch_lightning as pl
import torch
import transformers

import nxd_hf
from nxd_hf.lightning import (
    NeuronLTModule, NeuronTensorBoardLogger, NeuronTQDMProgressBar, NxDStrategy, checkpoint_progress, logging_rank,
)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero1", action="store_true", help="shard optimizer state over data-parallel ranks")
    parser.add_argument("--max-steps", type=int, default=40, help="steps to train in this run (after --resume: more)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="lightning_out")
    parser.add_argument("--resume", default=None, help="a checkpoint this example saved")
    return parser.parse_args()


def blocks(tokenizer, seq_len: int) -> list[dict]:
    ids = torch.tensor(tokenizer(open(os.path.join(DATA, "tiny_corpus.txt")).read())["input_ids"])
    starts = range(0, len(ids) - seq_len, seq_len // 4)
    return [{"input_ids": ids[s : s + seq_len], "labels": ids[s : s + seq_len]} for s in starts]


def load_model():
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.join(DATA, "tiny-llama"))


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["loss"]))


def main():
    args = parse_args()
    nxd_config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
        pipeline_config={"num_microbatches": 2} if args.pp > 1 else None,
        optimizer_config={"zero_one_enabled": args.zero1})
    module = NeuronLTModule(load_model, nxd_config, torch.optim.AdamW, torch.optim.lr_scheduler.LinearLR,
                            opt_kwargs={"lr": args.lr},
                            scheduler_kwargs={"start_factor": 1.0, "end_factor": 0.1, "total_iters": args.max_steps})
    data = blocks(transformers.AutoTokenizer.from_pretrained(os.path.join(DATA, "tiny-llama")), args.seq_len)
    per_replica = args.batch_size // nxd_hf.parallel_state.get_data_parallel_size()
    train = torch.utils.data.DataLoader(data, batch_size=per_replica, drop_last=True)
    val = torch.utils.data.DataLoader(data[:per_replica * 4], batch_size=per_replica)
    losses, first_step = Losses(), 0
    logs_here = torch.distributed.get_rank() == logging_rank()
    if args.resume:  # Lightning's max_steps counts from the first run's start
        progress = checkpoint_progress(args.resume)
        first_step = progress["global_step"]
        if logs_here:
            print(f"resuming from {args.resume} (step {progress['global_step']}, epoch {progress['epoch']}): "
                  f"training to step {first_step + args.max_steps}", flush=True)
    trainer = pl.Trainer(strategy=NxDStrategy(nxd_config), max_steps=first_step + args.max_steps,
                         val_check_interval=20, check_val_every_n_epoch=None,
                         callbacks=[NeuronTQDMProgressBar(), losses],
                         logger=NeuronTensorBoardLogger(os.path.join(args.output_dir, "tb")),
                         enable_checkpointing=False, default_root_dir=args.output_dir, log_every_n_steps=5)
    trainer.fit(module, train, val, ckpt_path=args.resume)
    trainer.save_checkpoint(os.path.join(args.output_dir, "last.ckpt"))
    val_loss = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    if logs_here and losses.losses:
        print(f"tp {args.tp} x pp {args.pp} x dp {nxd_hf.parallel_state.get_data_parallel_size()}: val_loss "
              f"{val_loss:.4f}; loss fell from {losses.losses[0]:.4f} to "
              f"{losses.losses[-1]:.4f}", flush=True)
    nxd_hf.parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
