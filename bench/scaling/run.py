"""How step time, peak memory per rank and bytes communicated grow with tp (1, 2, 4), pp (1, 2, 4),
sequence length (128 -> 2048, tp=2 with sequence parallelism and full activation checkpointing)
and model width, on tiny llamas (4 layers, vocab 8192, batch 4, fp32, AdamW), each point a fresh
``torch.distributed.run`` world on gloo/CPU (1 thread per rank), 1 warm-up step and 3 timed.

Columns: step time (median of the timed steps, the slowest rank); peak RssAnon per rank (the
worst rank, over the timed steps, sampled every 2 ms); payload bytes per rank in one step (what
the rank handed to collectives, ``nxd_hf.backend.count_comm``: the worst rank); "predicted":
the cost model of ``nxd_hf.plan`` where that package is importable, else "n/a".
On a shared 2-core machine step times of worlds above 2 ranks are oversubscribed: the memory and
byte columns are exact, the time column is what it was; the load average is recorded per point.

``python -m bench.scaling [--out bench/results/scaling.json] [--doc docs/scaling.md] [--only tp pp ...]``
writes the JSON, the table into docs/scaling.md and the plot docs/scaling.png.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, RESULTS
from bench.common.rank_results import rank_results
from bench.common.stamp import stamp
from bench.scaling.report import write_doc

BASE = dict(tp=1, pp=1, sp=False, ac=False, hidden=256, layers=4, vocab=8192, seq=128, batch=4, warmup=1, steps=3)
SWEEPS = {
    "tp": [dict(tp=t) for t in (1, 2, 4)],
    "pp": [dict(pp=p) for p in (1, 2, 4)],
    "seq": [dict(tp=2, sp=True, ac=True, seq=s) for s in (128, 512, 1024, 2048)],
    "width": [dict(tp=2, hidden=h) for h in (128, 256, 512, 1024)],
}


def launch(point: dict, timeout_s: float) -> dict:
    world = point["tp"] * point["pp"]
    with tempfile.TemporaryDirectory() as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "bench.scaling", "--worker", json.dumps(point), "--result-dir", result_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRANSFORMERS_VERBOSITY="error")
        load, start = os.getloadavg()[0], time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
            error = None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1][:300]
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f}s"
        ranks = rank_results(result_dir, world)
    if error or len(ranks) < world:
        return dict(point=point, world=world, error=error or "missing rank results")
    steps = [max(s) for s in zip(*(r["seconds"] for r in ranks))]
    return dict(point=point, world=world, error=None, step_seconds=statistics.median(steps),
                step_seconds_min_max=[min(steps), max(steps)], peak_anon=max(r["peak_anon"] for r in ranks),
                comm_bytes=max(r["comm_bytes"] for r in ranks), num_collectives=max(r["num_collectives"] for r in ranks),
                local_param_bytes=max(r["local_param_bytes"] for r in ranks), load_before=load,
                load_after=os.getloadavg()[0], launch_seconds=time.perf_counter() - start,
                predicted=predict(point))


def predict(point: dict) -> dict | None:
    """``nxd_hf.plan``'s cost model (``cpu`` preset) for ``point``'s layout: step seconds, peak bytes
    of the busiest rank (model state and activations; the bare process is not in it) and the
    payload bytes one rank hands to collectives in a step."""
    import transformers

    from nxd_hf.plan.api import plan

    config = transformers.LlamaConfig(
        hidden_size=point["hidden"], intermediate_size=point["hidden"] * 8 // 3 // 64 * 64 or 64,
        num_attention_heads=point["hidden"] // 64, num_key_value_heads=max(point["hidden"] // 128, 1),
        num_hidden_layers=point["layers"], vocab_size=point["vocab"], max_position_embeddings=point["seq"])
    fixed = dict(tp=point["tp"], pp=point["pp"], sequence_parallel=point["sp"], recompute=point["ac"], zero_1=False,
                 num_microbatches=point["pp"])
    try:
        result = plan(config, world_size=point["tp"] * point["pp"], device_memory="1TB", seq_len=point["seq"],
                      micro_batch_size=point["batch"] // point["pp"] if point["pp"] > 1 else point["batch"],
                      global_batch_size=point["batch"], device="cpu", fixed=fixed)
    except ValueError as error:
        return dict(error=str(error)[:200])
    if not result.ranked:
        return dict(error="; ".join(sorted({r.reason for r in result.rejected}))[:200])
    best = result.ranked[0]
    return dict(step_seconds=best.step_time, peak_bytes=best.peak_memory,
                comm_bytes=sum(t.payload_bytes for t in best.comm if t.axis != "pp"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "scaling.json"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "scaling.md"))
    parser.add_argument("--only", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from bench.scaling.rank import worker

        return worker(json.loads(args.worker), args.result_dir)
    start, done, rows = time.perf_counter(), {}, []
    for sweep in args.only:
        for change in SWEEPS[sweep]:
            point = dict(BASE, **change)
            key = json.dumps(point, sort_keys=True)
            if key not in done:  # tp=1 and pp=1 are the same point
                print(f"{sweep}: {change} ...", end=" ", flush=True)
                done[key] = launch(point, args.timeout)
                print(done[key].get("error") or f"{done[key]['step_seconds']:.2f} s/step", flush=True)
            rows.append(dict(done[key], sweep=sweep))
    if set(args.only) != set(SWEEPS) and os.path.exists(args.out):  # keep the other sweeps' rows of the last run
        with open(args.out) as f:
            rows = [r for r in json.load(f)["rows"] if r["sweep"] not in args.only] + rows
    result = dict(**stamp(), base=BASE, rows=rows, wall_seconds=time.perf_counter() - start)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    write_doc(result, args.doc)
    print(f"wrote {args.out} and {args.doc} in {result['wall_seconds']:.0f}s")
