"""nnScaler's Example 1 (parallelize a module, train it like a plain one) and Example 3 (an
end-to-end module trained with ``train_step``), written against the reference document with
``from nnscaler import ...`` changed to ``from nxd_hf.nnscaler import ...``.

    torchrun --nproc_per_node 4 examples/nnscaler_example.py --example 1 --policy tp --plan_ngpus 2 --use_zero
    torchrun --nproc_per_node 4 examples/nnscaler_example.py --example 3 --policy tp --plan_ngpus 2

Each run trains a few steps, merges every rank's state dicts (``merge_state_dicts``) and checks
that the original module loaded with them computes what the parallel module computes.
"""

import argparse
import os
import tempfile
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

from nxd_hf.nnscaler import ComputeConfig, build_optimizer, merge_state_dicts, parallelize


def init_random():
    torch.manual_seed(0)


class LLM(nn.Module):
    """Example 1's module: any plain module; forward(x) returns its output."""

    def __init__(self):
        init_random()
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.act = nn.GELU()
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class End2EndMLP(nn.Module):
    """Example 3's module, as in the document."""

    def __init__(self):
        init_random()
        super().__init__()
        self.layers = torch.nn.ModuleList([])
        for _ in range(8):
            self.layers.append(nn.Linear(16, 16, bias=False))
        self.loss_fn = nn.BCELoss()

    def forward(self, data: Dict[str, torch.Tensor]):
        x = data["data"]
        for layer in self.layers:
            x = layer(x)
        x = torch.sigmoid(x)
        loss = self.loss_fn(x, data["target"])
        return loss


def sample(step: int, unit: int, batch: int = 8) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + unit)
    data = torch.randn(batch, 16, generator=g)
    return {"data": data, "target": (data.flip(-1) > 0).float()}


def merged_module(cls, model, optimizer):
    """The original module loaded with the merged state dicts of every rank."""
    module_sds = [None] * dist.get_world_size()
    optimizer_sds = [None] * dist.get_world_size()
    dist.all_gather_object(module_sds, model.state_dict())
    dist.all_gather_object(optimizer_sds, optimizer.state_dict())
    module_sd, optimizer_sd = merge_state_dicts(module_sds, optimizer_sds)
    original = cls()
    original.load_state_dict(module_sd)
    torch.optim.Adam(original.parameters(), lr=1e-2).load_state_dict(optimizer_sd)
    return original


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", type=int, choices=[1, 3], default=1)
    parser.add_argument("--policy", default="tp")
    parser.add_argument("--plan_ngpus", type=int, default=2)
    parser.add_argument("--use_zero", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gen_savedir", default=os.path.join(tempfile.gettempdir(), "nxd_hf_nnscaler_example"))
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    unit = rank // args.plan_ngpus  # the document's data-parallel index (pp=1: nxd_hf's too)
    compute_config = ComputeConfig(plan_ngpus=args.plan_ngpus, runtime_ngpus=world, use_zero=args.use_zero,
                                   use_end2end=args.example == 3)
    cls = LLM if args.example == 1 else End2EndMLP
    dummy = {"x": sample(0, 0)["data"]} if args.example == 1 else {"data": sample(0, 0)}
    model = parallelize(cls(), dummy, args.policy, compute_config, gen_savedir=args.gen_savedir, reuse="override",
                        broadcast_strategy="all")
    optimizer = build_optimizer(model, torch.optim.Adam, lr=1e-2)
    losses = []
    for step in range(args.steps):
        batch = sample(step + 1, unit)
        model.train()
        if args.example == 1:
            loss = nn.functional.mse_loss(model(batch["data"]), batch["target"])
            loss.backward()
        else:
            loss = model.train_step([batch])[0]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    original = merged_module(cls, model, optimizer)
    model.eval()
    check = sample(10_000, 0)
    with torch.inference_mode():
        if args.example == 1:
            ours, theirs = model(check["data"]), original(check["data"])
        else:
            ours, theirs = model.infer_step([check])[0], original(check)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    if rank == 0:
        print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
        print("the original module loaded with the merged state dicts computes the parallel module's outputs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
