"""A LightningModule written the usual way (automatic optimization, the transformers model an
attribute, its own configure_optimizers), written with Lightning's unified package
(``import lightning as L``; pip install lightning), trained under nxd_hf's NxDStrategy:

    torchrun --nproc_per_node 2 examples/lightning_own_module.py --tp 2      # tensor parallel
    torchrun --nproc_per_node 2 examples/lightning_own_module.py             # data parallel

Nothing in the module knows about nxd_hf: the strategy parallelizes its Hugging Face model before
configure_optimizers, averages gradients over data-parallel replicas, clips by the whole model's
norm (gradient_clip_val) and saves OUT/last.ckpt as an nxd_hf checkpoint (loadable at any layout).
Pipeline parallelism and ZeRO-1 need NeuronLTModule (examples/lightning_causal_lm.py, written
with the pytorch_lightning package: nxd_hf.lightning takes whichever the script imported first).
"""

import argparse
import os

import lightning as L
import torch
import transformers

from nxd_hf.lightning import NxDStrategy

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


class CausalLM(L.LightningModule):
    def __init__(self, model_path: str, lr: float, warmup_steps: int):
        super().__init__()
        self.save_hyperparameters()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_path)
        self.first_loss = self.last_loss = None

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)  # sync_dist: the mean over data parallelism
        self.last_loss = float(loss)
        self.first_loss = self.first_loss or self.last_loss
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.model.named_parameters() if p.dim() > 1]  # no decay for norms
        rest = [p for n, p in self.model.named_parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                      lr=self.hparams.lr)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, self.hparams.warmup_steps,
                                                                 self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="lightning_own_out")
    args = parser.parse_args()

    strategy = NxDStrategy(tensor_parallel_size=args.tp)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(DATA, "tiny-llama"))
    ids = torch.tensor(tokenizer(open(os.path.join(DATA, "tiny_corpus.txt")).read())["input_ids"])
    blocks = [{"input_ids": ids[s : s + args.seq_len], "labels": ids[s : s + args.seq_len]}
              for s in range(0, len(ids) - args.seq_len, args.seq_len // 4)]
    world, tp = int(os.environ.get("WORLD_SIZE", 1)), args.tp
    # each data-parallel replica's share of the global batch (the strategy deals the rows out)
    train = torch.utils.data.DataLoader(blocks, batch_size=args.batch_size // (world // tp), drop_last=True)
    module = CausalLM(os.path.join(DATA, "tiny-llama"), args.lr, warmup_steps=args.max_steps // 10)
    trainer = L.Trainer(strategy=strategy, max_steps=args.max_steps, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=args.output_dir)
    trainer.fit(module, train)
    trainer.save_checkpoint(os.path.join(args.output_dir, "last.ckpt"))
    if trainer.is_global_zero:
        print(f"tp {tp} x dp {world // tp}: loss fell from {module.first_loss:.4f} to {module.last_loss:.4f}; "
              f"checkpoint {os.path.join(args.output_dir, 'last.ckpt')}", flush=True)


if __name__ == "__main__":
    main()
