"""Optimizer state bytes, peak memory and step time per rank: nxd_hf's ZeRO-1
(``NeuronZero1Optimizer``) beside plain data parallelism (AdamW + ``sync_data_parallel_grads``),
``torch.distributed.optim.ZeroRedundancyOptimizer`` and DeepSpeed ZeRO stage 1, all training the
same ~34M-parameter residual MLP with AdamW and gradient clipping at 1.0 on gloo (CPU).

- state bytes: this rank's per-element optimizer state (exp_avg, exp_avg_sq, and the fp32
  master slice where the method keeps one: nxd ZeRO-1 and DeepSpeed); ``fraction`` divides it
  by the same method's unsharded state (12 B/param with a master, else 8 B/param).
- peak memory: the rank's peak resident set (``VmHWM``, reset after imports) minus its resident
  set then, in a fresh set of processes per method (``memory_steps`` steps); it includes the
  model's parameters and gradients (the same for every method).
- step time: gradient sync + clipping + optimizer step (nxd ZeRO-1: ``step()``, which does the
  reduce-scatter; DeepSpeed: its ``allreduce_gradients`` at the end of ``backward``, timed by
  wrapping it, plus ``step()``). All methods live side by side in one set of processes and take
  turns step by step, so load from other processes on the machine hits them alike; per step
  the slowest rank, then the median over steps. Every method uses torch's AdamW (default
  implementation; nxd ZeRO-1 hands it its slice in 1 MiB chunks) and 25 MB buckets, 1 thread
  per rank. On gloo nxd's bucket reduce-scatter / all-gather are one reduce / broadcast per
  rank's chunk (``nxd_hf.backend`` says why).

Run from the repo root: ``python bench/optimizer.py [--out PATH] [--steps N]``. DeepSpeed is
optional (``pip install deepspeed``; run with ``DS_ACCELERATOR=cpu``, set here).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

from nxd_hf import parallel_state  # noqa: E402
from nxd_hf.optim import NeuronZero1Optimizer  # noqa: E402
from nxd_hf.parallel_layers.grads import sync_data_parallel_grads  # noqa: E402
from nxd_hf.testing import run_distributed  # noqa: E402

METHODS = ["plain_dp", "nxd_zero1", "torch_zero_redundancy", "deepspeed_zero1"]
CASES = [(2, False), (4, True)]  # (dp, oversubscribed: more ranks than the 2 cores)
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


def _batch(config: BenchConfig, step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    shape = (config.batch, config.seq, config.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _state_bytes(states, per_element) -> int:
    return sum(v.numel() * v.element_size() for s in states for v in s.values()
               if isinstance(v, torch.Tensor) and per_element(v))


class _Method:
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
                                                  max_norm=config.max_norm, bucket_size_mb=BUCKET_MB)
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


def _setup(names: list[str]) -> int:
    os.environ["DS_ACCELERATOR"] = "cpu"
    if "deepspeed_zero1" in names:
        import deepspeed  # noqa: F401  before the memory baseline
    parallel_state.initialize_model_parallel(1, 1)  # every rank data-parallel
    return parallel_state.get_data_parallel_rank()


def _build(name: str, config: BenchConfig) -> _Method:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _Method(name, build_model(config), config)


def measure_memory(name: str, config: BenchConfig) -> dict:
    """One rank's state bytes and peak memory for one method, in fresh processes."""
    dp_rank = _setup([name])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    baseline = _rss_bytes("VmRSS")
    method = _build(name, config)
    losses = []
    for step in range(config.memory_steps):
        losses.append(method.forward_backward(*_batch(config, step, dp_rank)))
        method.update()
    checksum = sum(float(p.detach().double().sum()) for p in method.model.parameters())
    return dict(state_bytes=method.state_bytes(), full_state_bytes=method.full_state_bytes(),
                peak_bytes=_rss_bytes("VmHWM") - baseline, num_params=method.num_params, losses=losses,
                param_checksum=checksum)


def measure_times(names: list[str], config: BenchConfig) -> dict[str, list[float]]:
    """One rank's step seconds of every method, built side by side and interleaved step by
    step (the order rotating), so that load from other processes hits them alike."""
    dp_rank = _setup(names)
    methods = {name: _build(name, config) for name in names}
    seconds = {name: [] for name in names}
    for step in range(config.warmup + config.steps):
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            methods[name].forward_backward(*_batch(config, step, dp_rank))
            elapsed = methods[name].update()
            if step >= config.warmup:
                seconds[name].append(elapsed)
    return seconds


def _deepspeed_status() -> str | None:
    """None when DeepSpeed is installed, else why it cannot run (a failure to run is caught later)."""
    import importlib.util

    return None if importlib.util.find_spec("deepspeed") else "deepspeed is not installed (pip install deepspeed)"


def _run_or_reason(fn, dp: int, *args):
    try:
        return run_distributed(fn, dp, *args, timeout_s=600), None
    except Exception as e:  # a peer failing here is recorded, not fatal
        return None, f"{type(e).__name__}: {str(e)[-500:]}"


def run(config: BenchConfig) -> dict:
    ds_problem = _deepspeed_status()
    names = [n for n in METHODS if not (n == "deepspeed_zero1" and ds_problem)]
    cases = []
    for dp, oversubscribed in CASES:
        per_rank_times, timing_problem = _run_or_reason(measure_times, dp, names, config)
        for name in METHODS:
            case = dict(dp=dp, oversubscribed=oversubscribed, method=name)
            per_rank, problem = (None, ds_problem) if name not in names else _run_or_reason(measure_memory, dp, name, config)
            if problem or timing_problem:
                cases.append({**case, "skipped": problem or timing_problem})
                continue
            step_times = [max(r[name][i] for r in per_rank_times) for i in range(config.steps)]
            state = max(r["state_bytes"] for r in per_rank)
            cases.append({
                **case, "num_params": per_rank[0]["num_params"], "state_bytes_per_rank": state,
                "state_fraction": state / per_rank[0]["full_state_bytes"],
                "peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank),
                "step_seconds": statistics.median(step_times), "step_seconds_all": step_times,
                "final_loss": per_rank[0]["losses"][-1], "param_checksum": per_rank[0]["param_checksum"],
            })
    return dict(config=dataclasses.asdict(config), cases=cases, targets=_targets(cases), deepspeed=ds_problem or "ran",
                cpus=os.cpu_count(), torch=torch.__version__)


def _targets(cases: list[dict]) -> dict:
    """ZeRO-1 state = 1/dp (+-1%) at every dp; step time <= both peers' at dp 2."""
    out = {}
    for case in cases:
        if case["method"] == "nxd_zero1" and "skipped" not in case:
            out[f"state_1_over_dp_dp{case['dp']}"] = abs(case["state_fraction"] * case["dp"] - 1) <= 0.01
    timed = {c["method"]: c["step_seconds"] for c in cases if c["dp"] == 2 and "skipped" not in c}
    for peer in ("torch_zero_redundancy", "deepspeed_zero1"):
        if peer in timed and "nxd_zero1" in timed:
            out[f"step_time_le_{peer}_dp2"] = timed["nxd_zero1"] <= timed[peer]
    return out


def format_table(result: dict) -> str:
    lines = ["| dp | method | state MB/rank | state / unsharded | peak MB/rank | step ms | final loss |",
             "|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        dp = f"{c['dp']}{' (oversubscribed)' if c['oversubscribed'] else ''}"
        if "skipped" in c:
            lines.append(f"| {dp} | {c['method']} | skipped: {c['skipped'][:120]} |  |  |  |  |")
            continue
        lines.append(f"| {dp} | {c['method']} | {c['state_bytes_per_rank'] / 2**20:.1f} | {c['state_fraction']:.4f} | "
                     f"{c['peak_bytes_per_rank'] / 2**20:.0f} | {c['step_seconds'] * 1e3:.0f} | {c['final_loss']:.5f} |")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in result["targets"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "optimizer.json"))
    parser.add_argument("--steps", type=int, default=BenchConfig.steps)
    args = parser.parse_args(argv)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    result = run(BenchConfig(steps=args.steps))
    result["wall_seconds"] = time.perf_counter() - start
    result["load_average_1min"] = [load_before, os.getloadavg()[0]]  # other processes on the machine
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(result))
    print(f"wrote {args.out} in {result['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
