"""Timing one rank's pipeline steps for ``bench/pipeline/run.py``: busy time per action, the
machine's CPU use by other processes, waiting for a quiet machine."""

import os
import time
from collections import defaultdict

import torch.distributed as dist

QUIET_CORES = 0.2  # other processes' CPU use (cores) below which the machine counts as quiet


class BusyClock:
    """Sums the time a rank spends in its stages' compute calls and the loss; keeps each call's
    duration under (stage, kind) — F forward (+ loss), B full backward, I input grad, W weight
    grad — and, for the current step, each action's duration under "stage:kind:microbatch"."""

    def __init__(self, stages, schedule):
        self.busy, self.calls, self.cpu, self.actions = 0.0, defaultdict(list), defaultdict(list), {}
        self._last_forward = None
        for stage in stages:
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", None),
                                 ("backward_weight_one_chunk", "W")):
                setattr(stage, method, self._timed(getattr(stage, method), stage.stage_index, kind))
        last = stages[0].num_stages - 1
        schedule._compute_loss = self._timed(schedule._compute_loss, last, "loss")

    def _timed(self, fn, stage_index: int, kind):
        def timed(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.busy += elapsed
            key = (stage_index, kind or ("B" if kwargs.get("full_backward", True) else "I"))
            self.calls[key].append(elapsed)
            self.cpu[key].append(time.thread_time() - start_cpu)
            if kind == "loss":  # follows the last stage's forward of the same microbatch
                self.actions[self._last_forward] += elapsed
            else:
                action = f"{key[0]}:{key[1]}:{args[0]}"  # the chunk id is the first argument
                self.actions[action] = elapsed
                self._last_forward = action
            return out
        return timed


def zero_grads(params) -> None:
    """In place (``zero_grad(set_to_none=False)``): fresh gradient buffers every step cost page
    faults that depend on the heap's state, not on the pipeline, and blur the comparison."""
    for p in params:
        if p.grad is not None:
            p.grad.zero_()


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, all processes): /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(max_wait_s: float) -> float:
    """Rank 0 waits (at most ``max_wait_s``) until the machine's other processes use less than
    ``QUIET_CORES`` (this run's ranks sit in a barrier meanwhile); returns the seconds waited."""
    waited = 0.0
    if dist.get_rank() == 0:
        while waited < max_wait_s:
            before = machine_busy_s()
            time.sleep(0.5)
            waited += 0.5
            if (machine_busy_s() - before) / 0.5 < QUIET_CORES:
                break
    dist.barrier()
    return waited


def timed_step(step, params, clock: BusyClock) -> tuple[float, float, float, float, dict]:
    """(wall s, busy s, CPU s of this process, CPU s of the whole machine, each action's s) of
    one step."""
    zero_grads(params)
    clock.busy, clock.actions = 0.0, {}
    dist.barrier()
    start, start_cpu, start_machine = time.perf_counter(), time.process_time(), machine_busy_s()
    step()
    wall = time.perf_counter() - start
    return wall, clock.busy, time.process_time() - start_cpu, machine_busy_s() - start_machine, clock.actions

