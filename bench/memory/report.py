"""The per-launch summary, the targets and the table of ``bench/memory/run.py``."""

PARAM_SLACK, PEAK_SLACK = 1.05, 1.25
MiB = 2**20


def summarize(run: dict) -> dict:
    """Worst rank of a launch: the numbers the targets are checked on."""
    if run["error"]:
        return dict(loader=run["loader"], tp=run["tp"], error=run["error"])
    ranks = run["ranks"]
    worst = max(ranks, key=lambda r: r["peak_anon"] - r["baseline_anon"])
    return dict(
        loader=run["loader"], tp=run["tp"], error=None,
        param_bytes=max(r["param_bytes"] for r in ranks), ideal_bytes=max(r["ideal_bytes"] for r in ranks),
        bare_anon=worst["bare_anon"], baseline_anon=worst["baseline_anon"], peak_anon=worst["peak_anon"],
        load_anon=worst["peak_anon"] - worst["baseline_anon"], peak_file=max(r["peak_file"] for r in ranks),
        file_backed_param_bytes=worst["file_backed_param_bytes"],
        anon_plus_mapped=worst["peak_anon"] - worst["baseline_anon"] + worst["file_backed_param_bytes"],
        load_seconds=max(r["seconds"] for r in ranks),
    )


def check_targets(ours: dict, theirs: dict | None) -> dict:
    checks = dict(
        param_bytes=ours["param_bytes"] <= PARAM_SLACK * ours["ideal_bytes"],
        peak_anon=ours["load_anon"] <= PEAK_SLACK * ours["param_bytes"],
    )
    if theirs and not theirs["error"]:
        checks["not_above_transformers"] = ours["peak_anon"] <= theirs["peak_anon"]
    return checks


def format_table(rows: list[dict]) -> str:
    cols = (f"{'loader':<13} {'tp':>2} {'params':>7} {'ideal':>7} {'ratio':>5} {'bare':>6} {'base':>6} {'peak':>7} "
            f"{'pk-base':>7} {'target':>7} {'ok':>4} {'file pk':>7} {'mmap':>7} {'anon+mm':>7} {'load s':>6}")
    lines = ["MiB per rank (worst rank). bare: RssAnon with torch+transformers+nxd_hf imported; base: + model code "
             "imported; peak: peak RssAnon during the load; target: 1.25 x params for pk-base; file pk: peak RssFile; "
             "mmap: parameter bytes that are copy-on-write views of the mapped safetensors files (not anonymous); "
             "anon+mm: pk-base + mmap", cols, "-" * len(cols)]
    for row in rows:
        if row["error"]:
            lines.append(f"{row['loader']:<13} {row['tp']:>2} FAILED: {row['error']}")
            continue
        checks = row.get("checks", {})
        ok = "" if not checks else "yes" if checks["peak_anon"] else "NO"
        lines.append(
            f"{row['loader']:<13} {row['tp']:>2} {row['param_bytes'] / MiB:>7.1f} {row['ideal_bytes'] / MiB:>7.1f} "
            f"{row['param_bytes'] / row['ideal_bytes']:>5.3f} {row['bare_anon'] / MiB:>6.1f} "
            f"{row['baseline_anon'] / MiB:>6.1f} {row['peak_anon'] / MiB:>7.1f} {row['load_anon'] / MiB:>7.1f} "
            f"{PEAK_SLACK * row['param_bytes'] / MiB:>7.1f} {ok:>4} {row['peak_file'] / MiB:>7.1f} "
            f"{row['file_backed_param_bytes'] / MiB:>7.1f} {row['anon_plus_mapped'] / MiB:>7.1f} "
            f"{row['load_seconds']:>6.1f}")
    lines.append("")
    for row in rows:
        if row.get("checks"):
            lines.append(f"nxd_hf tp={row['tp']}: " + ", ".join(
                f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in row["checks"].items()))
    return "\n".join(lines)
