"""Training throughput and peak memory per rank on the ~125M llama of ``bench/`` (hidden 768,
12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000; batch 4 x 128 tokens; fp32;
AdamW at lr 5e-5, clipping at 1.0), four ways, on CPU:

- ``nxd_trainer``: ``nxd_hf.NxDTrainer`` with ``NxDTrainingArguments(tensor_parallel_size=2)``
  on 2 ranks, a dataset of random token rows (labels = input_ids); steps timed by a
  ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (setup, the data fetch and the
  logging outside; on_step_end -> on_step_end, with them, recorded beside);
- ``nxd_loop``: ``nxd_hf.parallelize(model, tensor_parallel_size=2)``, ``torch.optim.AdamW``,
  ``loss.backward()``, ``nxd_hf.parallel_layers.grads.clip_grad_norm``, ``step()``; 2 ranks;
- ``hf_tp``: transformers' own TP, ``from_pretrained(..., distributed_config=DistributedConfig(
  tp_size=2))`` (``from_config`` takes no distributed config, so a random checkpoint of the same
  weights is written once), trained by ``transformers.Trainer`` where accelerate lets it be built
  (on CPU under torchrun it does not: ``use_cpu=True`` -> "ParallelismConfig is only compatible
  ... got MULTI_CPU", without it -> "total_size (2) does not match num_processes (1)"), else by
  the bare loop with ``Trainer``'s mixed-mesh clipping; the table says which; 2 ranks;
- ``single``: the plain HF model, the bare loop, one process with 2 threads.

2-rank cases run under ``torch.distributed.run`` (gloo, OMP_NUM_THREADS=1 per rank). Each
launch is a fresh set of processes; the first ``--warmup`` steps are dropped. tokens/s =
batch x seq / the step time (per step the slowest rank, then the median over steps);
tokens/CPU-s = batch x seq / the process CPU seconds of all ranks in a step (median over steps),
which load from other processes on the machine disturbs far less than wall time. Peak RSS:
``VmHWM`` of the whole run per rank (the worst rank), beside its "bare" reading (imports done,
process group up) and the training-only peak (``VmHWM`` reset once the model is built). The
floor is (parameters + gradients + 2 AdamW moments) x 4 B / tp + bare. Every case is launched
``--repeats`` times, the cases taking turns; median and min-max over repeats. The JSON is
rewritten after every launch.

Added with the overlap work: ``nxd_loop_tp1`` (the bare loop through ``parallelize`` at tp=1, one
process, 2 threads), ``nxd_zero1`` (NxDTrainer tp=1 x dp=2 with ZeRO-1), and ``overlap_dp2`` /
``overlap_tp2dp2`` (the bare loop on ``--overlap-layers`` layers with the gradient reduction's
overlap switched on and off every other step in one run: the ratio of the medians, with the
spread). Memory: every rank samples RssAnon every 1 ms through the steps (``memtrace``), phases
marked (forward, backward, clip, optimizer, zero_grad); the table itemizes each phase's peak
above the step's start, for the first step and the last, against the floor on RssAnon
((params + grads + AdamW [/dp with ZeRO-1]) / tp + the bare process's RssAnon; ``memory_report``).
Honest throughput (``judge``): through the run, the CPU time other processes took (the machine's
busy time from /proc/stat minus this run's own processes) and the steal time are measured, and the
1-min load average sampled beside; throughput ratios are printed only when other processes used at
most 5% of the cores the run uses and steal stayed under 5%, else they are withheld with the reason
(the load average alone cannot judge it: it counts the run's own sampler threads and launcher, and
a 2-rank run alone on 2 cores reads 2.0-2.5); tokens per CPU-second per rank (the rank's user +
system seconds per step) are always recorded.

Added later: ``overlap_zero1_dp2`` / ``overlap_zero1_tp2dp2`` (the same switch for
ZeRO-1's reduce-scatter started during backward or in ``step()``), and ``deepspeed_autotp``
(DeepSpeed's AutoTP training at tp=2, a peer of ``nxd_loop``, ``hf_tp`` and ``single``;
DeepSpeed is not a dependency: pass ``--deepspeed-path`` (a ``pip install --no-deps --target``
folder) or have it importable; the case is skipped with the reason printed when it does not import).

Run from the repo root: ``python -m bench.train_step [--layers 12] [--steps 5] [--warmup 2]
[--repeats 3] [--cases ...] [--out PATH]``; ``--report PATH`` prints an earlier run's table;
a quick check: ``--layers 2 --steps 3 --warmup 1 --repeats 1 --out /tmp/train_step.json``.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.common.rank_results import rank_results
from bench.common import REPO, RESULTS
from bench.common.stamp import stamp
from bench.train_step.rank import CASES, worker
from bench.train_step.judge import LoadWatch, verdict
from bench.train_step.report import CORES, format_table, summarize

WORLD = {"nxd_trainer": 2, "nxd_loop": 2, "hf_tp": 2, "single": 1, "nxd_loop_tp1": 1, "nxd_zero1": 2,
         "overlap_dp2": 2, "overlap_tp2dp2": 4, "overlap_zero1_dp2": 2, "overlap_zero1_tp2dp2": 4,
         "deepspeed_autotp": 2}
DEFAULT_CASES = ["nxd_trainer", "nxd_loop", "hf_tp", "single", "nxd_loop_tp1", "nxd_zero1", "overlap_dp2",
                 "overlap_tp2dp2"]


def ensure_checkpoint(opts: dict) -> str:
    """The random fp32 checkpoint ``hf_tp`` loads (the same weights as ``plain_model``)."""
    from bench.train_step.rank import plain_model

    path = os.path.join(tempfile.gettempdir(), f"nxd_hf_bench_train_step_l{opts['layers']}_s{opts['seq']}")
    if not os.path.exists(os.path.join(path, "config.json")):
        plain_model(opts["layers"], opts["seq"]).save_pretrained(path)
    return path


def num_params(opts: dict) -> int:
    import torch
    import transformers

    from bench.train_step.rank import llama_config

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(opts["layers"], opts["seq"]))
    return sum(p.numel() for p in model.parameters())


def launch(case: str, opts: dict, timeout_s: float) -> dict:
    """One fresh world for ``case``; the per-rank results or the error."""
    world = WORLD[case]
    with tempfile.TemporaryDirectory() as result_dir:
        script = ["-m", "bench.train_step", "--worker", case, "--opts", json.dumps(opts), "--result-dir", result_dir]
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                                  if world > 1 else []) + script
        env = dict(os.environ, OMP_NUM_THREADS=str(1 if world > 1 else 2), NXD_HF_BENCH_THREADS=str(1 if world > 1 else 2), PYTHONPATH=str(REPO),
                   TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        env.update(_case_env(case, opts))
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {_last_error(proc.stderr)}"
            stderr_tail = None if proc.returncode == 0 else proc.stderr[-4000:]
        except subprocess.TimeoutExpired as e:
            error = f"timed out after {timeout_s:.0f}s"
            stderr_tail = (e.stderr or b"")[-4000:].decode(errors="replace")
        ranks = rank_results(result_dir, world)
    if len(ranks) < world and error is None:
        error = "missing rank results"
    return dict(case=case, world=world, launch_seconds=time.perf_counter() - start, error=error,
                stderr_tail=stderr_tail, ranks=ranks if len(ranks) == world else [])


def _case_env(case: str, opts: dict) -> dict:
    """DeepSpeed (not a dependency) from ``--deepspeed-path`` on the CPU accelerator, for its case only."""
    if case != "deepspeed_autotp":
        return {}
    path = os.pathsep.join(p for p in (opts.get("deepspeed_path"), str(REPO)) if p)
    extensions = os.path.join(tempfile.gettempdir(), "nxd_hf_bench_torch_extensions")  # its shm op, built once
    return dict(DS_ACCELERATOR="cpu", PYTHONPATH=path, TORCH_EXTENSIONS_DIR=extensions)


def deepspeed_missing(opts: dict) -> str | None:
    """Why ``deepspeed_autotp`` cannot run here (deepspeed does not import), or None."""
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (opts.get("deepspeed_path"), str(REPO)) if p))
    proc = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    return None if proc.returncode == 0 else f"deepspeed does not import: {_last_error(proc.stderr)}"


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:400]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "train_step.json"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--overlap-layers", type=int, default=2, help="layers of the overlap_* cases' model")
    parser.add_argument("--hf-tp-loop", action="store_true", help="train hf_tp with the bare loop, not Trainer")
    parser.add_argument("--deepspeed-path", help="a folder holding deepspeed (pip install --target; not a dependency) "
                        "for the deepspeed_autotp case; default: wherever python finds it")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--append", action="store_true", help="add this run's launches to those of --out (same "
                        "options; each invocation stays short on a shared machine)")
    parser.add_argument("--report", metavar="JSON", help="print the table of an earlier (or partial) run and exit")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--opts", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, json.loads(args.opts), args.result_dir)
    if args.report:
        with open(args.report) as f:
            return print(format_table(json.load(f)))

    start, load_before = time.perf_counter(), os.getloadavg()[0]
    opts = dict(layers=args.layers, seq=args.seq, batch=args.batch, steps=args.warmup + args.steps,
                warmup=args.warmup, hf_tp_loop=args.hf_tp_loop, overlap_layers=args.overlap_layers,
                deepspeed_path=args.deepspeed_path)
    skipped = {}
    if "deepspeed_autotp" in args.cases and (reason := deepspeed_missing(opts)):
        print(f"skipping deepspeed_autotp: {reason}")
        skipped["deepspeed_autotp"] = reason
        args.cases = [c for c in args.cases if c != "deepspeed_autotp"]
        if not args.cases:
            return None
    if "hf_tp" in args.cases:
        opts["checkpoint"] = ensure_checkpoint(opts)
    result = dict(**stamp(), config=dict(opts, timed_steps=args.steps, repeats=args.repeats),
                  num_params=num_params(opts), num_params_overlap=num_params(dict(opts, layers=args.overlap_layers)),
                  cpus=os.cpu_count(), runs=[], skipped=skipped)
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        if earlier["config"] != result["config"]:
            raise ValueError(f"--append: {args.out} was measured with other options {earlier['config']}")
        result["runs"], result["skipped"] = earlier["runs"], {**earlier.get("skipped", {}), **skipped}
        result["earlier_load"] = [*earlier.get("earlier_load", []), earlier["load"]]
    cores_used = max(CORES.get(case, 2) for case in args.cases)
    with LoadWatch() as watch:
        for repeat in range(args.repeats):
            for case in args.cases:
                print(f"repeat {repeat + 1}/{args.repeats} {case} ...", end=" ", flush=True)
                with LoadWatch() as launch_watch:
                    run = launch(case, opts, args.timeout)
                print(f"{run['launch_seconds']:.0f}s" + (f" FAILED: {run['error']}" if run["error"] else ""), flush=True)
                result["runs"].append(dict(run, repeat=repeat, load=launch_watch.result()))
                result["load"] = verdict(watch.result(), cores_used, os.cpu_count())
                for earlier_load in result.get("earlier_load", []):  # quiet only if every invocation was
                    reasons = list(dict.fromkeys([*result["load"]["reasons"], *earlier_load["reasons"]]))
                    result["load"] = dict(result["load"], quiet=result["load"]["quiet"] and earlier_load["quiet"],
                                          reasons=reasons)
                result.update(summarize(result), wall_seconds=time.perf_counter() - start,
                              load_average_1min=[load_before, os.getloadavg()[0]])  # other processes on the machine
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print()
    print(format_table(result))
    print(f"wrote {args.out} in {result['wall_seconds']:.0f}s (1-min load average {load_before:.1f} before, "
          f"{result['load_average_1min'][1]:.1f} after, {os.cpu_count()} cpus)")
