"""The model and the four training setups of ``bench/optimizer/run.py``: plain data parallelism,
nxd_hf's ZeRO-1, torch's ``ZeroRedundancyOptimizer`` and DeepSpeed ZeRO stage 1."""

import dataclasses
import time

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.optim import NeuronZero1Optimizer
from nxd_hf.parallel_layers.grads import sync_data_parallel_grads

BUCKET_MB = 25


@dataclasses.dataclass(kw_only=True)
class BenchConfig:
    hidden: int = 1024  # model width
    ffn: int = 4096  # MLP inner width
    num_layers: int = 4  # residual MLP blocks
    batch: int = 2  # sequences per rank per step
    seq: int = 32  # tokens per sequence
    steps: int = 12  # timed steps per method
    warmup: int = 2  # untimed steps first
    memory_steps: int = 3  # steps of the memory pass (AdamW state exists after the first)
    lr: float = 1e-3  # AdamW learning rate
    max_norm: float = 1.0  # gradient clipping, every method


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(config: BenchConfig) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(config.hidden, config.ffn) for _ in range(config.num_layers)])


def _state_bytes(states, per_element) -> int:
    return sum(v.numel() * v.element_size() for s in states for v in s.values()
               if isinstance(v, torch.Tensor) and per_element(v))


class Method:
    """One training setup: ``backward`` (returns seconds of it spent in gradient sync) and
    ``update`` (sync + clip + step), ``state_bytes`` and ``full_state_bytes``."""

    def __init__(self, name: str, model: nn.Module, config: BenchConfig):
        self.name, self.model, self.config = name, model, config
        self.num_params = sum(p.numel() for p in model.parameters())
        self.dp_group = parallel_state.get_data_parallel_group()
        if name == "plain_dp":
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        elif name == "nxd_zero1":
            self.optimizer = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=config.lr,
                                                  grad_clipping=config.max_norm is not None, max_norm=config.max_norm,
                                                  bucket_size_mb=BUCKET_MB)
        elif name == "torch_zero_redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                     process_group=self.dp_group, lr=config.lr)
        else:
            self._init_deepspeed()

    def _init_deepspeed(self):
        import deepspeed

        elements = BUCKET_MB * 1024 * 1024 // 4
        ds_config = {
            "train_micro_batch_size_per_gpu": self.config.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": self.config.max_norm, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 1, "reduce_bucket_size": elements, "allgather_bucket_size": elements,
                                  "overlap_comm": False},
        }
        client = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=client, config=ds_config)
        self.sync_seconds = 0.0
        allreduce = self.engine.allreduce_gradients

        def timed_allreduce(*args, **kwargs):
            start = time.perf_counter()
            allreduce(*args, **kwargs)
            self.sync_seconds += time.perf_counter() - start

        self.engine.allreduce_gradients = timed_allreduce

    def forward_backward(self, x, target) -> float:
        if self.name == "deepspeed_zero1":
            self.sync_seconds = 0.0
            loss = nn.functional.mse_loss(self.engine(x), target)
            self.engine.backward(loss)
            return loss.item()
        loss = nn.functional.mse_loss(self.model(x), target)
        loss.backward()
        return loss.item()

    def update(self) -> float:
        """Seconds of gradient sync + clipping + optimizer step."""
        start = time.perf_counter()
        if self.name == "deepspeed_zero1":
            in_backward = self.sync_seconds  # a reduction inside step() is in the wall time below
            self.engine.step()
            return time.perf_counter() - start + in_backward
        if self.name == "nxd_zero1":
            self.optimizer.step()
        else:
            sync_data_parallel_grads(self.model.parameters(), bucket_size_mb=BUCKET_MB)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_norm)
            self.optimizer.step()
        seconds = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return seconds

    def state_bytes(self) -> int:
        if self.name == "nxd_zero1":
            return self.optimizer.optimizer_state_bytes()
        if self.name == "deepspeed_zero1":
            masters = self.optimizer.single_partition_of_fp32_groups
            sizes = {m.numel() for m in masters}
            return sum(m.numel() * 4 for m in masters) + _state_bytes(
                self.optimizer.optimizer.state.values(), lambda v: v.numel() in sizes)
        inner = self.optimizer.optim if self.name == "torch_zero_redundancy" else self.optimizer
        return _state_bytes(inner.state.values(), lambda v: v.dim() > 0)

    def full_state_bytes(self) -> int:
        """The same method's state unsharded: 12 B/param with an fp32 master copy, else 8."""
        with_master = self.name in ("nxd_zero1", "deepspeed_zero1")
        return self.num_params * (12 if with_master else 8)
