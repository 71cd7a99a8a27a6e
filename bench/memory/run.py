"""Memory of loading a ~0.5B-parameter Llama checkpoint under tensor parallelism, per rank:
``nxd_hf.from_pretrained`` beside transformers' own tensor-parallel loading on the same files.

For tp in {1, 2, 4} and each loader, one fresh ``torch.distributed.run`` launch (gloo, CPU):

- parameter bytes per rank (unique local parameters; a DTensor counts its local shard), beside
  the ideal of the loader's own plan: (unsharded bytes of the parameters it shards) / tp +
  bytes of the parameters it replicates (both loaders shard everything but the norms);
- peak anonymous memory: ``RssAnon`` from /proc/self/status, sampled every ~5 ms by a thread
  during the load (``VmHWM`` would count the safetensors files' mapped pages, which the kernel
  can drop at any time), beside the baseline taken just before the load: torch, transformers
  and nxd_hf imported, process group up, and the model's code imported (``import_model_code``,
  ~80 MiB whatever the model's size; "bare" is the process without it). ``RssFile`` peaks are
  recorded for information;
- parameter bytes that are copy-on-write views of the mapped safetensors files. transformers
  keeps every contiguous slice that way (all parameters at tp=1), so they never enter RssAnon
  until written; nxd_hf copies every local slice into its own memory. "anon+mmap" (peak - base
  + mapped parameter bytes) compares the two on equal terms.

Targets (nxd_hf): parameter bytes <= 1.05 x ideal; peak - baseline <= 1.25 x parameter bytes;
peak not above transformers' at the same tp.

Run from the repo root: ``python -m bench.memory [--out PATH] [--ckpt-dir DIR] [--tp 1 2 4]``.
The random checkpoint is written once (bf16, ~1 GB, sharded with an index) and reused.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.memory.checkpoint import DEFAULT_CKPT, checkpoint_summary, ensure_checkpoint
from bench.memory.rank import worker
from bench.memory.report import MiB, PARAM_SLACK, PEAK_SLACK, check_targets, format_table, summarize
from bench.common.rank_results import rank_results
from bench.common import REPO, RESULTS
from bench.common.stamp import stamp

LOADERS = ("nxd_hf", "transformers")


def launch(loader: str, path: str, tp: int, timeout_s: float) -> dict:
    """One fresh torch.distributed.run world of ``tp`` ranks; per-rank results or the error."""
    with tempfile.TemporaryDirectory() as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
               "-m", "bench.memory", "--worker", loader, "--tp", str(tp), "--ckpt-dir", path,
               "--result-dir", result_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRANSFORMERS_VERBOSITY="error")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {_last_error(proc.stderr)}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f}s"
        ranks = rank_results(result_dir, tp)
    if len(ranks) < tp and error is None:
        error = "missing rank results"
    return dict(loader=loader, tp=tp, wall_s=time.perf_counter() - start, error=error,
                ranks=ranks if len(ranks) == tp else [])


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:300]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "memory.json"))
    parser.add_argument("--ckpt-dir", default=DEFAULT_CKPT)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--worker", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.ckpt_dir, args.tp[0], args.result_dir)

    start = time.perf_counter()
    ensure_checkpoint(args.ckpt_dir)
    checkpoint = checkpoint_summary(args.ckpt_dir)
    print(f"checkpoint: {checkpoint['num_params']:,} params, {checkpoint['param_bytes'] / MiB:.0f} MiB bf16 "
          f"in {checkpoint['files']} files", flush=True)
    runs, rows = [], []
    for tp in args.tp:
        by_loader = {}
        for loader in LOADERS:
            print(f"launch: {loader} tp={tp} ...", end=" ", flush=True)
            run = launch(loader, args.ckpt_dir, tp, args.timeout)
            print(f"{run['wall_s']:.0f}s" + (f" FAILED: {run['error']}" if run["error"] else ""), flush=True)
            runs.append(run)
            by_loader[loader] = summarize(run)
        ours = by_loader["nxd_hf"]
        if not ours["error"]:
            ours["checks"] = check_targets(ours, by_loader["transformers"])
        rows += [by_loader[loader] for loader in LOADERS]
    print()
    print(format_table(rows))
    total_s = time.perf_counter() - start
    passed = all(row.get("checks") and all(row["checks"].values()) for row in rows if row["loader"] == "nxd_hf")
    print(f"\nnxd_hf targets: {'all PASS' if passed else 'some FAIL'}; total {total_s:.0f}s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        targets = dict(param_bytes=f"<= {PARAM_SLACK} x ideal", peak_anon=f"peak - base <= {PEAK_SLACK} x param bytes",
                       not_above_transformers="peak RssAnon <= transformers' (same base)")
        json.dump(dict(**stamp(), checkpoint=checkpoint, targets=targets, rows=rows, runs=runs, all_pass=passed,
                       total_seconds=total_s), f, indent=1)
    print(f"wrote {args.out}")
