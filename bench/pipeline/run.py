"""Pipeline bubbles and step time of ``nxd_hf``'s automatic pipeline against theory and against a
hand-split ``torch.distributed.pipelining`` pipeline of the same model.

One *process* per rank (``nxd_hf.testing.run_distributed``: gloo on CPU, ``torch.set_num_threads(1)``),
not one thread: threads would share one interpreter lock, processes give each rank a core. A
Llama-shaped HF model (``MODEL``; one microbatch's forward through the whole model takes
~370 ms on one core, well above the 50 ms floor, so that the runtime's fixed cost per action,
~1-2 ms of p2p and Python here, weighs little) is built with the same seed on every rank. For
every schedule of
``nxd_hf.pipeline.runtime.SCHEDULES`` (V = 2 where it runs several stages per rank) and each
number of microbatches M:

- ours: ``nxd_hf.parallelize(model, pipeline_parallel_size=P, num_microbatches=M, schedule=...)``
  and ``run_train`` (time to partition = the ``parallelize`` call: trace, cut, split);
- hand: the same layers split by hand into stage modules (embedding + layers / layers /
  layers + norm + lm_head, each computing RoPE itself, causal attention without a mask
  tensor) run by the same runtime (``nxd_hf.pipeline.runtime.build_schedule``: torch's stages
  and schedule class, with the first stage's backward split for the zero-bubble schedules)
  with the same loss — the ceiling for an automatic partitioner.

Both are warmed up, then timed alternately (ours, hand, hand, ours, ...) so that drift in the
machine's load hits both alike; medians over the timed steps. Busy time per rank is the sum of
its stages' ``forward_one_chunk``/``backward_one_chunk``/``backward_weight_one_chunk`` calls
and the loss; step time is the slowest rank's wall time from a barrier; a rank's bubble is
1 - busy / step time, averaged over ranks. Theory: (P-1)/(M+P-1) for 1F1B and GPipe,
(P-1)/(VM+P-1) for interleaved 1F1B and looped BFS, the replayed action lists
(``bench/pipeline/bubbles.py``, F = I = W) for the zero-bubble schedules; "replay" is the same
replay with the measured per-stage action times instead of unit costs, "exact" replays each
step with that step's measured time of every action. Exact replay minus theory is what the
action times themselves cost (stages of unequal cost, ranks slowed at random by the VM);
measured minus exact replay is the runtime's cost between actions (p2p, Python).

Targets (P = 2): bubble within max(10% relative, 2 points) of theory; ours' step time <= 1.05x
the hand split. P = 4 runs 4 ranks on this machine's 2 cores: printed, marked oversubscribed,
no target.

Both see the same batch and weights; their first losses must agree (checked). Gradients are
zeroed in place between steps. Per step, the machine's CPU use by other processes is recorded
("other"); rows where it reaches ``QUIET_CORES`` are marked noisy, and ``--quiet-wait S`` makes
each case wait up to S seconds for a quiet machine first.

Run from the repo root: ``python -m bench.pipeline [--out PATH] [--pp 2 4] [--microbatches 4 8]
[--oversubscribed-microbatches 8] [--schedules ...] [--steps N] [--quiet-wait S]``.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import nxd_hf
from bench.pipeline.hand import MICROBATCH, MODEL, SEQ, build_hand, build_model, make_batch
from bench.pipeline.summary import BUBBLE_ABS, BUBBLE_REL, LEGEND, STEP_SLACK, format_rows, summarize
from bench.pipeline.timing import QUIET_CORES, BusyClock, timed_step, wait_until_quiet, zero_grads
from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf import parallel_state
from nxd_hf.pipeline.runtime import SCHEDULES
from nxd_hf.testing import run_distributed


def _forward_ms() -> float:
    """One microbatch's forward through the whole model, single process, median of 3."""
    model = build_model()
    ids, _ = make_batch(1)
    times = []
    with torch.no_grad():
        for _ in range(4):
            start = time.perf_counter()
            model(input_ids=ids[:MICROBATCH])
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def measure_case(name: str, num_microbatches: int, virtual: int, warmup: int, steps: int,
                 quiet_wait_s: float) -> dict:
    """This rank's records for one (schedule, M): per timed step (``_timed_step``) of each
    implementation, median action times (wall and CPU), time to partition, first-step time."""
    pp_size = dist.get_world_size()
    gc.collect()  # the previous case's models sit in reference cycles (hooks): free them first
    parallel_state.destroy_model_parallel()
    model = build_model()
    waited = wait_until_quiet(quiet_wait_s)
    start = time.perf_counter()
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=pp_size, num_microbatches=num_microbatches,
                                  schedule=name, virtual_pipeline_size=virtual)
    partition_s = time.perf_counter() - start
    ids, labels = make_batch(num_microbatches)
    mask = torch.ones_like(ids)
    ours_params = list(pp_model.local_parameters())
    hand_step, hand_stages, hand_schedule, hand_params = build_hand(name, pp_size, num_microbatches, virtual, labels)
    steps_of = {"ours": lambda: pp_model.run_train(input_ids=ids, attention_mask=mask, labels=labels),
                "hand": lambda: hand_step(ids)}
    params_of = {"ours": ours_params, "hand": hand_params}
    first_step, first_loss = {}, {}
    for impl, step in steps_of.items():
        for i in range(warmup):
            zero_grads(params_of[impl])
            dist.barrier()
            start = time.perf_counter()
            loss = step()
            if i == 0:
                first_step[impl] = time.perf_counter() - start
                first_loss[impl] = None if loss is None else float(loss.detach())
    (ours_schedule,) = pp_model._runner.schedules.values()
    ours_stages = ours_schedule._stages if SCHEDULES[name][2] else [ours_schedule._stage]
    clocks = {"ours": BusyClock(ours_stages, ours_schedule), "hand": BusyClock(hand_stages, hand_schedule)}
    timed = {"ours": [], "hand": []}
    for i in range(steps):
        for impl in (("ours", "hand") if i % 2 == 0 else ("hand", "ours")):
            timed[impl].append(timed_step(steps_of[impl], params_of[impl], clocks[impl]))
    calls = {impl: {f"{s}:{k}": statistics.median(v) for (s, k), v in clock.calls.items()}
             for impl, clock in clocks.items()}
    cpu = {impl: {f"{s}:{k}": statistics.median(v) for (s, k), v in clock.cpu.items()}
           for impl, clock in clocks.items()}
    parallel_state.destroy_model_parallel()
    return dict(timed=timed, calls=calls, cpu=cpu, partition_s=partition_s, first_step_s=first_step,
                first_loss=first_loss, quiet_wait_s=waited)


def run_cases(cases: list[tuple[str, int, int]], warmup: int, steps: int, quiet_wait_s: float) -> dict:
    """Worker: every case on this rank, plus the forward time of one microbatch."""
    wait_until_quiet(quiet_wait_s)
    forward_ms = _forward_ms()
    return dict(forward_ms=forward_ms,
                cases=[_logged(measure_case, name, m, v, warmup, steps, quiet_wait_s) for name, m, v in cases])


def _logged(measure, name: str, num_microbatches: int, *args) -> dict:
    start = time.perf_counter()
    record = measure(name, num_microbatches, *args)
    if dist.get_rank() == 0:
        print(f"  P={dist.get_world_size()} M={num_microbatches} {name}: {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--oversubscribed-microbatches", type=int, nargs="+", default=[8],
                        help="M for the P that exceed the core count (their rows have no target)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each case, wait up to this many seconds for other processes to go quiet")
    args = parser.parse_args(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows, forward_ms = [], {}
    for pp_size in args.pp:
        oversubscribed = pp_size > (os.cpu_count() or 1)
        microbatches = args.oversubscribed_microbatches if oversubscribed else args.microbatches
        cases = [(name, m, 2 if SCHEDULES[name][2] else 1) for m in microbatches for name in args.schedules]
        per_rank = run_distributed(run_cases, pp_size, cases, args.warmup, args.steps, args.quiet_wait,
                                   timeout_s=3600)
        forward_ms[pp_size] = per_rank[0]["forward_ms"]
        for i, (name, m, v) in enumerate(cases):
            rows.append(summarize(name, pp_size, m, v, [r["cases"][i] for r in per_rank]))
    load_after = os.getloadavg()
    print(f"one process per rank (nxd_hf.testing.run_distributed: gloo, CPU, 1 thread each), not threads; "
          f"{os.cpu_count()} cores\nmodel {MODEL}, microbatch {MICROBATCH}x{SEQ} tokens; one microbatch's forward "
          "through the whole model: " + ", ".join(f"{ms:.0f} ms (with {p} ranks up)" for p, ms in forward_ms.items()))
    print(f"{args.warmup} warm-up + {args.steps} timed steps per implementation, alternating, medians; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print(format_rows(rows))
    print("\n" + LEGEND.format(quiet=QUIET_CORES))
    checked = [r for r in rows if not r["oversubscribed"]]
    all_pass = all(r["bubble_ok"] and r["step_ok"] for r in checked)
    print(f"\ntargets (P=2): bubble within max({BUBBLE_REL:.0%} rel, {BUBBLE_ABS:.0%} abs) of theory, "
          f"step <= {STEP_SLACK}x hand: {'all met' if all_pass else 'MISSED'}; "
          f"{sum(r['noisy'] for r in rows)} of {len(rows)} rows noisy; total {time.perf_counter() - started:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(**stamp(), model=MODEL, seq=SEQ, microbatch=MICROBATCH, ranks_as="processes", threads_per_rank=1,
                       cpu_count=os.cpu_count(), forward_ms=forward_ms, warmup=args.warmup, steps=args.steps,
                       load_average=dict(before=load_before, after=load_after), quiet_cores=QUIET_CORES,
                       targets=dict(bubble=f"|ours - theory| <= max({BUBBLE_REL} x theory, {BUBBLE_ABS}) (P=2)",
                                    step=f"ours <= {STEP_SLACK} x hand (P=2)"),
                       rows=rows, all_pass=all_pass), f, indent=1)
    print(f"wrote {args.out}")
