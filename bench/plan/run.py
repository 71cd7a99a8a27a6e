"""The plan's cost model against measurement: a grid of small real layouts (``bench/plan/models.py``:
tp/pp/dp, sequence parallelism, ZeRO-1, recomputation, LoRA on three tiny-to-small models, worlds
of 1, 2 and 4 gloo ranks on CPU) each trained for a few steps through ``nxd_hf.parallelize``:

- peak memory per rank: peak RssAnon (sampled every 2 ms) minus the rank's baseline just before
  the layout is built, beside ``nxd_hf.plan``'s predicted peak for that rank (target: ratio within
  1 +- 0.10 for every rank of every layout);
- parameter bytes per rank (LoRA included) beside the prediction (target: equal);
- communication of the last step: payload bytes per (group, collective) counted by
  ``nxd_hf.backend.count_comm``, and the pipeline's sends, beside the predicted terms (target: equal);
- step time: the Spearman rank correlation of predicted (``cpu`` preset, ranks sharing the
  machine's cores) and measured times (the fastest step after the first, wall clock and the
  process's CPU time; absolute times on a shared CPU mean little).

Run from the repo root: ``python -m bench.plan [--out PATH] [--steps N] [--grid grid|extra|sweep] [--seq N]
[--only WORDS]...`` (``--only``: the layouts whose model and layout name hold all the words);
JSON in bench/results/plan.json. ``--grid extra``: layouts outside the grid (GPT-2 at tp2, Phi-3 under
gpipe and SP + recompute, Qwen2 ZeRO-1 + LoRA); ``--grid sweep``: more architectures at a few layouts.
"""

import argparse
import json
import os
import time

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.common.table import Column, table
from bench.plan.compare import compare_case, layout_of, measured_ranks, pairs_ordered, spearman
from bench.plan.models import EXTRA, FSDP, GRID, MODELS, SWEEP

MICRO_BATCH, SEQ = 2, 128


GRIDS = {"grid": GRID, "extra": EXTRA, "sweep": SWEEP, "fsdp": FSDP}


def _runs(model: str, options: dict) -> bool:
    """Whether the sweep's layout applies to this architecture."""
    import torch

    from nxd_hf.architectures import get_patch

    config = MODELS[model]()
    if options.get("sequence_parallel") and not get_patch(config).sequence_parallel:
        return False
    if options.get("lora"):
        with torch.device("meta"):
            import transformers

            names = [n for n, _ in transformers.AutoModelForCausalLM.from_config(config).named_modules()]
        return any(n.endswith("q_proj") for n in names)
    return True


def _selected(case: dict, only: list[str]) -> bool:
    """Whether ``--only``'s patterns pick this case: each pattern's words must all be in the model
    name and its layout name (``Layout.name()``, `` lora`` appended)."""
    words = f"{case['model']} {layout_of(case).name()}{' lora' if case['lora'] else ''}".split()
    return any(all(w in words for w in pattern.split()) for pattern in only)


def cases(steps: int, grid: str = "grid", seq: int = SEQ, only: list[str] | None = None) -> list[dict]:
    out = []
    for model, tp, pp, dp, options in GRIDS[grid]:
        if grid == "sweep" and not _runs(model, options):
            continue
        out.append(dict(model=model, tp=tp, pp=pp, dp=dp, sequence_parallel=options.get("sequence_parallel", False),
                        recompute=options.get("recompute", False), lora=options.get("lora", False), lora_r=8,
                        zero_1=options.get("zero_1", False), schedule=options.get("schedule"),
                        data_parallel_sharding=options.get("data_parallel_sharding"),
                        num_microbatches=options.get("num_microbatches", 1), micro_batch=MICRO_BATCH, seq=seq,
                        steps=steps))
    return [c for c in out if _selected(c, only)] if only else out


def measure(all_cases: list[dict]) -> list[list[dict]]:
    """Per case, every rank's measurement: one spawn per world size."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # every tensor its own mapping, returned when freed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from nxd_hf.testing import run_distributed
    from bench.plan.worker import run_cases

    results: list = [None] * len(all_cases)
    for world in sorted({c["tp"] * c["pp"] * c["dp"] for c in all_cases}):
        index = [i for i, c in enumerate(all_cases) if c["tp"] * c["pp"] * c["dp"] == world]
        start = time.perf_counter()
        per_rank = run_distributed(run_cases, world, [all_cases[i] for i in index], timeout_s=max(600, 60 * len(index)))
        print(f"world {world}: {len(index)} layouts in {time.perf_counter() - start:.0f}s", flush=True)
        for j, i in enumerate(index):
            results[i] = [rank[j] for rank in per_rank]
    return results


_COLUMNS = [Column(title="model", width=10, left=True), Column(title="layout", width=34, left=True),
            Column(title="rank", width=4), Column(title="pred MiB", width=9, spec=".1f"),
            Column(title="meas MiB", width=9, spec=".1f"), Column(title="ratio", width=6, spec=".3f"),
            Column(title="param B ok", width=10), Column(title="comm B ok", width=9),
            Column(title="pred s", width=8, spec=".4f"), Column(title="meas s", width=7, spec=".2f"),
            Column(title="cpu s", width=6, spec=".2f")]


def format_rows(rows: list[dict]) -> str:
    lines = [(row["model"], row["layout"], r["rank"], r["predicted_peak"] / 2**20, r["measured_peak"] / 2**20,
              r["memory_ratio"], str(r["param_bytes_equal"]), str(r["comm_equal"]), row["predicted_step_s"],
              row["measured_step_s"], row["measured_step_cpu_s"]) for row in rows for r in row["ranks"]]
    return "\n".join(table(_COLUMNS, lines, rule=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "plan.json"))
    parser.add_argument("--steps", type=int, default=4, help="training steps per layout (the last is counted)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="grid", help="which list of layouts")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--only", action="append", metavar="WORDS",
                        help='run only the layouts whose model and layout name hold all these words, e.g. '
                             '"zero1" or "gpt2-s pp2" (repeatable: any pattern)')
    parser.add_argument("--repredict", metavar="JSON",
                        help="no run: set a saved run's measurements beside the current cost model")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.repredict:
        with open(args.repredict) as f:
            saved = json.load(f)
        all_cases = [row["case"] for row in saved["rows"]]
        measured = [measured_ranks(row) for row in saved["rows"]]
        args.seq, args.grid, args.steps = saved["seq_len"], saved.get("grid", "grid"), saved["steps"]
    else:
        all_cases = cases(args.steps, args.grid, args.seq, args.only)
        if not all_cases:
            raise ValueError(f"--only {args.only} matches no layout of --grid {args.grid}")
        measured = measure(all_cases)
    rows = [compare_case(case, ranks) for case, ranks in zip(all_cases, measured)]
    print(format_rows(rows))
    ratios = [r["memory_ratio"] for row in rows for r in row["ranks"]]
    predicted = [row["predicted_step_s"] for row in rows]
    wall, cpu = [row["measured_step_s"] for row in rows], [row["measured_step_cpu_s"] for row in rows]
    rho, rho_cpu = spearman(predicted, wall), spearman(predicted, cpu)
    (far, far_right), (far_cpu, far_cpu_right) = pairs_ordered(predicted, wall), pairs_ordered(predicted, cpu)
    summary = dict(
        memory_ratio_min=min(ratios), memory_ratio_max=max(ratios),
        memory_within_10pct=all(0.9 <= x <= 1.1 for x in ratios),
        param_bytes_equal=all(r["param_bytes_equal"] for row in rows for r in row["ranks"]),
        comm_bytes_equal=all(r["comm_equal"] for row in rows for r in row["ranks"]),
        step_time_spearman=rho, step_cpu_time_spearman=rho_cpu,
        step_time_pairs_1_25x_apart=far, step_time_pairs_1_25x_apart_ordered=far_right,
        step_cpu_time_pairs_1_25x_apart=far_cpu, step_cpu_time_pairs_1_25x_apart_ordered=far_cpu_right,
        total_seconds=time.perf_counter() - start)
    print("\n" + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(**stamp(), micro_batch=MICRO_BATCH, seq_len=args.seq, grid=args.grid, steps=args.steps, summary=summary, rows=rows),
                  f, indent=1)
    print(f"wrote {args.out}")
