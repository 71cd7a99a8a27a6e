"""docs/scaling.md and docs/scaling.png from the JSON of ``bench/scaling/run.py``."""

import os

MiB = 2**20
AXIS = {"tp": "tp", "pp": "pp", "seq": "seq", "width": "hidden"}
TITLE = {"tp": "tensor parallel (pp=1, hidden 256, seq 128)", "pp": "pipeline parallel (tp=1, microbatches = pp)",
         "seq": "sequence length (tp=2, sequence parallel, full activation checkpointing)",
         "width": "model width (tp=2, seq 128)"}


def _predicted(row: dict, key: str) -> str:
    predicted = row.get("predicted")
    if not isinstance(predicted, dict) or key not in predicted:
        return "n/a"
    value = predicted[key]
    return f"{value:.3f}" if key == "step_seconds" else f"{value / MiB:.2f}" if key == "comm_bytes" else f"{value / MiB:.0f}"


def table(result: dict) -> list[str]:
    lines = []
    for sweep, title in TITLE.items():
        rows = [r for r in result["rows"] if r["sweep"] == sweep]
        if not rows:
            continue
        lines += ["", f"### {title}", "",
                  f"| {AXIS[sweep]} | ranks | step s (min-max) | predicted step s | peak RssAnon MiB/rank | predicted MiB "
                  "| params MiB/rank | comm MiB/rank/step | predicted comm MiB | collectives/step | load avg |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            x = r["point"][AXIS[sweep]]
            if r["error"]:
                lines.append(f"| {x} | {r['world']} | FAILED: {r['error'][:120]} |")
                continue
            lo, hi = r["step_seconds_min_max"]
            lines.append(f"| {x} | {r['world']} | {r['step_seconds']:.3f} ({lo:.3f}-{hi:.3f}) | "
                         f"{_predicted(r, 'step_seconds')} | {r['peak_anon'] / MiB:.0f} | {_predicted(r, 'peak_bytes')} | "
                         f"{r['local_param_bytes'] / MiB:.1f} | {r['comm_bytes'] / MiB:.2f} | {_predicted(r, 'comm_bytes')} | "
                         f"{r['num_collectives']} | "
                         f"{r['load_before']:.1f} |")
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [s for s in TITLE if any(r["sweep"] == s and not r["error"] for r in result["rows"])]
    fig, axes = plt.subplots(3, len(sweeps), figsize=(3.6 * len(sweeps), 8.5), squeeze=False)
    for col, sweep in enumerate(sweeps):
        rows = [r for r in result["rows"] if r["sweep"] == sweep and not r["error"]]
        xs = [r["point"][AXIS[sweep]] for r in rows]
        for row, (key, label, scale) in enumerate([("step_seconds", "step time (s)", 1),
                                                   ("peak_anon", "peak RssAnon / rank (MiB)", MiB),
                                                   ("comm_bytes", "comm / rank / step (MiB)", MiB)]):
            ax = axes[row][col]
            ax.plot(xs, [r[key] / scale for r in rows], "o-", label="measured")
            predicted_key = {"step_seconds": "step_seconds", "peak_anon": "peak_bytes", "comm_bytes": "comm_bytes"}[key]
            predicted = [(x, r["predicted"][predicted_key] / scale) for x, r in zip(xs, rows)
                         if isinstance(r.get("predicted"), dict) and predicted_key in r["predicted"]]
            if predicted:
                ax.plot(*zip(*predicted), "s--", label="predicted (nxd_hf.plan)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(AXIS[sweep])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(sweep)
                ax.legend(fontsize=7)
    fig.suptitle(f"nxd_hf scaling, {result['date']}, {result['machine'][:60]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_doc(result: dict, path: str) -> None:
    png = os.path.splitext(path)[0] + ".png"
    plot(result, png)
    has_prediction = any(isinstance(r.get("predicted"), dict) for r in result["rows"])
    base = result["base"]
    lines = ["# Scaling: step time, memory and communication as the layout and the model grow", "",
             f"Measured {result['date']} on {result['machine']} by `python -m bench.scaling` "
             f"({result['wall_seconds']:.0f} s; JSON: `bench/results/scaling.json`). Tiny llamas: "
             f"{base['layers']} layers, vocab {base['vocab']}, batch {base['batch']}, fp32, AdamW, gloo on CPU, "
             "1 thread per rank; 1 warm-up step, median of 3 timed steps (slowest rank).", "",
             "- peak RssAnon: the worst rank's anonymous memory over the timed steps (sampled every 2 ms), "
             "the process's own ~300 MiB (torch, transformers, nxd_hf imported) included;",
             "- comm: payload bytes the worst rank handed to collectives in one step "
             "(`nxd_hf.backend.count_comm`; all-reduce: the whole tensor, all-gather: the local shard);",
             "- pp: the stage-to-stage activations and their gradients go through torch.distributed.pipelining's "
             "own batched isend/irecv (asynchronous work handles), which `count_comm` does not see: per rank and "
             "step, b x s x hidden x 4 bytes each way per stage boundary (1 MiB at the base point); the column shows "
             "the counted collectives only;",
             "- the machine has 2 cores shared with other jobs: worlds of 4 ranks are oversubscribed and "
             "every time is what it was under the load average shown; bytes and parameter sizes are exact.",
             "- predicted: " + ("the cost model of `nxd_hf.plan` (`cpu` preset) for the same layout: step "
                                "seconds, the busiest rank's model state and activations (the bare process's ~300 "
                                "MiB is not in it), and the collectives' payload bytes (pipeline sends excluded, as "
                                "in the measured column: equal wherever they are counted)." if has_prediction else
                                "n/a: `nxd_hf.plan` (built in parallel) was not importable (or has no "
                                "`estimate`) when this ran; `bench/scaling/run.py`'s `predict` fills the column "
                                "once it is."),
             "", "![measured vs predicted](scaling.png)"]
    with open(path, "w") as f:
        f.write("\n".join(lines + table(result)) + "\n")
