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

Run from the repo root: ``python -m bench.optimizer [--out PATH] [--steps N]``. DeepSpeed is
optional (``pip install deepspeed``; run with ``DS_ACCELERATOR=cpu``, set here).
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from bench.optimizer.methods import BenchConfig
from bench.optimizer.rank import measure_memory, measure_times
from bench.optimizer.report import check_targets, format_table
from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf.testing import run_distributed

METHODS = ["plain_dp", "nxd_zero1", "torch_zero_redundancy", "deepspeed_zero1"]
CASES = [(2, False), (4, True)]  # (dp, oversubscribed: more ranks than the 2 cores)


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
            per_rank, problem = ((None, ds_problem) if name not in names
                                 else _run_or_reason(measure_memory, dp, name, config))
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
    return dict(config=dataclasses.asdict(config), cases=cases, targets=check_targets(cases),
                deepspeed=ds_problem or "ran", cpus=os.cpu_count(), torch=torch.__version__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.optimizer", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "optimizer.json"))
    parser.add_argument("--steps", type=int, default=BenchConfig.steps)
    args = parser.parse_args(argv)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    result = {**stamp(), **run(BenchConfig(steps=args.steps))}
    result["wall_seconds"] = time.perf_counter() - start
    result["load_average_1min"] = [load_before, os.getloadavg()[0]]  # other processes on the machine
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(result))
    print(f"wrote {args.out} in {result['wall_seconds']:.0f}s")
