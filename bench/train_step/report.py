"""The per-case summary (median and min-max over repeats), the ratios and the table of
``bench/train_step/run.py``."""

import statistics

from bench.train_step.memory_report import floor_bytes, format_memory, worst_rank_memory

MiB = 2**20
# case -> (tp, dp, ZeRO-1, processes x threads); tp/dp/ZeRO-1 set the floor
LAYOUT = {"nxd_trainer": (2, 1, False), "nxd_loop": (2, 1, False), "hf_tp": (2, 1, False), "single": (1, 1, False),
          "nxd_loop_tp1": (1, 1, False), "nxd_zero1": (1, 2, True), "overlap_dp2": (1, 2, False),
          "overlap_tp2dp2": (2, 2, False), "overlap_zero1_dp2": (1, 2, True), "overlap_zero1_tp2dp2": (2, 2, True),
          "deepspeed_autotp": (2, 1, False)}
CORES = {"overlap_tp2dp2": 4, "overlap_zero1_tp2dp2": 4}  # the others: 2 ranks x 1 thread or 1 process x 2 threads
AIMS = dict(trainer_over_loop=0.97, trainer_over_hf_tp_throughput=1.0, trainer_over_hf_tp_rss=1.0)


def _median_step(ranks: list[dict], key: str, warmup: int) -> float | None:
    """Per step the slowest rank, then the median over the timed steps."""
    per_rank = [r[key][max(warmup - 1, 0):] if key == "intervals" else r[key][warmup:] for r in ranks]
    if not per_rank[0]:
        return None
    return statistics.median(max(steps) for steps in zip(*per_rank))


def _median_cpu_step(ranks: list[dict], warmup: int) -> float | None:
    """Per step the CPU seconds of all ranks together, then the median over the timed steps."""
    if "cpu_seconds" not in ranks[0]:  # runs before the field existed
        return None
    return statistics.median(sum(steps) for steps in zip(*(r["cpu_seconds"][warmup:] for r in ranks)))


def _per_rank_cpu(ranks: list[dict], tokens: int, warmup: int) -> list[float]:
    """Tokens per CPU-second of each rank: its median CPU seconds (user + system, all its threads)
    per timed step; at tp every rank of a replica processes all the batch's tokens."""
    return [tokens / statistics.median(r["cpu_seconds"][warmup:]) for r in ranks]


def per_run(run: dict, tokens: int, warmup: int, num_params: int) -> dict:
    ranks = run["ranks"]
    tp, dp, zero1 = LAYOUT[run["case"]]
    memory = worst_rank_memory(ranks, num_params, tp=tp, dp=dp, zero1=zero1) if "memtrace" in ranks[0] else None
    worst = max(ranks, key=lambda r: max(r["setup_peak_rss"], r["train_peak_rss"]) - r["bare_rss"])
    step = _median_step(ranks, "seconds", warmup)
    interval = _median_step(ranks, "intervals", warmup) if ranks[0]["intervals"] else None
    cpu = _median_cpu_step(ranks, warmup)
    peak = max(worst["setup_peak_rss"], worst["train_peak_rss"])
    return dict(tokens_per_s=tokens / step, step_seconds=step, tokens_per_cpu_s=tokens / cpu if cpu else None,
                tokens_per_s_incl_data_logging=tokens / interval if interval else None,
                peak_rss=peak, bare_rss=worst["bare_rss"], peak_above_bare=peak - worst["bare_rss"],
                train_peak_rss=max(r["train_peak_rss"] for r in ranks),
                setup_peak_rss=max(r["setup_peak_rss"] for r in ranks), mean_loss=ranks[0]["mean_loss"],
                trained_by=ranks[0].get("trained_by"), trainer_refused=ranks[0].get("trainer_refused"),
                memory=memory, peak_anon_over_floor=memory and memory["peak_anon_over_floor"],
                tokens_per_cpu_s_per_rank=_per_rank_cpu(ranks, tokens, warmup) if "cpu_seconds" in ranks[0] else None,
                overlap=_overlap(ranks, warmup) if "overlap" in ranks[0] else None)


def _overlap(ranks: list[dict], warmup: int) -> dict:
    """Step time (slowest rank) with the overlap on and off, interleaved in one run."""
    steps = [max(per_step) for per_step in zip(*(r["seconds"] for r in ranks))]
    on = [t for t, o in list(zip(steps, ranks[0]["overlap"]))[warmup:] if o]
    off = [t for t, o in list(zip(steps, ranks[0]["overlap"]))[warmup:] if not o]
    if not on or not off:
        return None
    return dict(on=_spread(on), off=_spread(off), ratio=statistics.median(on) / statistics.median(off),
                num_buckets=ranks[0]["num_buckets"])


def _spread(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarize(result: dict) -> dict:
    config, num_params = result["config"], result["num_params"]
    tokens = config["batch"] * config["seq"]
    cases, errors = {}, {}
    for run in result["runs"]:
        if run["error"]:
            errors.setdefault(run["case"], []).append(run["error"])
            continue
        params = result.get("num_params_overlap", num_params) if run["case"].startswith("overlap") else num_params
        cases.setdefault(run["case"], []).append(per_run(run, tokens, config["warmup"], params))
    summary = {}
    for case, runs in cases.items():
        keep = ("mean_loss", "trained_by", "trainer_refused", "memory", "tokens_per_cpu_s_per_rank", "overlap")
        row = {key: _spread([r[key] for r in runs]) for key in runs[0] if key not in keep}
        tp, dp, zero1 = LAYOUT[case]
        row.update(tp=tp, dp=dp, zero1=zero1, repeats=len(runs), mean_losses=[r["mean_loss"] for r in runs],
                   trained_by=runs[-1]["trained_by"], trainer_refused=runs[-1]["trainer_refused"],
                   memory=runs[-1]["memory"], tokens_per_cpu_s_per_rank=[r["tokens_per_cpu_s_per_rank"] for r in runs],
                   overlap=[r["overlap"] for r in runs if r["overlap"]])
        params = result.get("num_params_overlap", num_params) if case.startswith("overlap") else num_params
        row["floor"] = floor_bytes(params, tp=tp, dp=dp, zero1=zero1, bare=row["bare_rss"]["median"])
        row["peak_over_floor"] = row["peak_rss"]["median"] / row["floor"]
        summary[case] = row
    quiet = result.get("load", {}).get("quiet", False)
    ratios = _ratios(summary)  # memory ratios need no quiet machine; throughput ratios do
    timed = {k: v for k, v in ratios.items() if k.endswith("throughput") or k == "trainer_over_loop"}
    return dict(summary=summary, errors=errors, ratios={k: v for k, v in ratios.items() if quiet or k not in timed},
                ratios_withheld=None if quiet else timed)


def _ratios(summary: dict) -> dict:
    def med(case, key):
        return summary[case][key]["median"] if case in summary else None

    out = {}
    if med("nxd_trainer", "tokens_per_s") and med("nxd_loop", "tokens_per_s"):
        value = med("nxd_trainer", "tokens_per_s") / med("nxd_loop", "tokens_per_s")
        out["trainer_over_loop"] = dict(value=value, aim=">= 0.97", met=value >= AIMS["trainer_over_loop"])
    if med("nxd_trainer", "tokens_per_s") and med("hf_tp", "tokens_per_s"):
        value = med("nxd_trainer", "tokens_per_s") / med("hf_tp", "tokens_per_s")
        out["trainer_over_hf_tp_throughput"] = dict(value=value, aim=">= 1.0", met=value >= 1.0)
        value = med("nxd_trainer", "peak_rss") / med("hf_tp", "peak_rss")
        out["trainer_over_hf_tp_rss"] = dict(value=value, aim="<= 1.0", met=value <= 1.0)
    for peer in ("deepspeed_autotp", "hf_tp", "single"):  # the bare loops side by side
        if med("nxd_loop", "tokens_per_s") and med(peer, "tokens_per_s"):
            value = med("nxd_loop", "tokens_per_s") / med(peer, "tokens_per_s")
            out[f"loop_over_{peer}_throughput"] = dict(value=value, aim="report", met=True)
        if med("nxd_loop", "tokens_per_cpu_s") and med(peer, "tokens_per_cpu_s"):  # needs no quiet machine
            value = med("nxd_loop", "tokens_per_cpu_s") / med(peer, "tokens_per_cpu_s")
            out[f"loop_over_{peer}_tokens_per_cpu_s"] = dict(value=value, aim="report", met=True)
    return out


def _fmt(spread: dict | None, scale: float = 1.0, digits: int = 0) -> str:
    if spread is None:
        return "-"
    return (f"{spread['median'] / scale:.{digits}f} ({spread['min'] / scale:.{digits}f}-"
            f"{spread['max'] / scale:.{digits}f})")


NAMES = {"nxd_trainer": "NxDTrainer tp=2", "nxd_loop": "nxd_hf bare loop tp=2", "single": "1 process, 2 threads",
         "nxd_loop_tp1": "nxd_hf bare loop tp=1 (1 process, 2 threads)", "nxd_zero1": "NxDTrainer tp=1 dp=2 ZeRO-1",
         "overlap_dp2": "overlap switch, bare loop dp=2", "overlap_tp2dp2": "overlap switch, bare loop tp=2 x dp=2",
         "overlap_zero1_dp2": "overlap switch, ZeRO-1 dp=2", "overlap_zero1_tp2dp2": "overlap switch, ZeRO-1 tp=2 x dp=2",
         "deepspeed_autotp": "DeepSpeed AutoTP tp=2"}


def format_table(result: dict) -> str:
    hf_tp_row = result["summary"].get("hf_tp", {})
    hf_tp = f"transformers TP tp=2, {hf_tp_row.get('trained_by') or 'transformers.Trainer'}"
    names = NAMES | {"hf_tp": hf_tp}
    only_overlap = all(case.startswith("overlap") for case in result["summary"])
    params = result.get("num_params_overlap", result["num_params"]) if only_overlap else result["num_params"]
    lines = [f"{params:,} params; median (min-max) over repeats; RSS in MiB per rank (worst rank); "
             "peak: VmHWM of the whole run; train peak: after the model is built; "
             "floor: 16 B/param / tp + bare; mean loss: over all steps of a launch",
             "| case | tokens/s | tokens/s incl. data+logging | tokens/CPU-s | peak RSS | peak - bare | train peak | "
             "bare | floor | peak/floor | mean loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, row in result["summary"].items():
        lines.append(f"| {names[case]} | {_fmt(row['tokens_per_s'], digits=1)} | "
                     f"{_fmt(row['tokens_per_s_incl_data_logging'], digits=1)} | "
                     f"{_fmt(row.get('tokens_per_cpu_s'), digits=1)} | {_fmt(row['peak_rss'], MiB)} | "
                     f"{_fmt(row['peak_above_bare'], MiB)} | {_fmt(row['train_peak_rss'], MiB)} | "
                     f"{_fmt(row['bare_rss'], MiB)} | {row['floor'] / MiB:.0f} | {row['peak_over_floor']:.2f} | "
                     f"{statistics.median(row['mean_losses']):.4f} |")
    for case, errors in result["errors"].items():
        lines.append(f"| {names[case]} | FAILED {len(errors)}x: {errors[-1][:200]} |")
    if hf_tp_row.get("trainer_refused"):
        lines.append(f"transformers TP trained by the bare loop: {hf_tp_row['trainer_refused']}")
    for name, ratio in result["ratios"].items():
        verdict = "" if ratio["aim"] == "report" else f" (aim {ratio['aim']}: {'met' if ratio['met'] else 'NOT met'})"
        lines.append(f"{name}: {ratio['value']:.3f}{verdict}")
    for case, reason in result.get("skipped", {}).items():
        lines.append(f"{case} skipped: {reason}")
    load = result.get("load")
    if load and not load["quiet"]:
        lines.append("throughput ratios WITHHELD: " + "; ".join(load["reasons"]) + " -- compare tokens/CPU-s instead")
    lines += ["", "tokens per CPU-second per rank (user + system time of the rank's process, median step):"]
    for case, row in result["summary"].items():
        per_rank = [r for r in row.get("tokens_per_cpu_s_per_rank", []) if r]
        if per_rank:
            lines.append(f"- {names[case]}: " + "; ".join(", ".join(f"{v:.1f}" for v in run) for run in per_rank))
    for case, row in result["summary"].items():
        for overlap in row.get("overlap", []):
            lines.append(f"- {names[case]} ({overlap['num_buckets']} buckets): step with overlap "
                         f"{_fmt(overlap['on'], digits=3)} s, without {_fmt(overlap['off'], digits=3)} s, "
                         f"ratio {overlap['ratio']:.3f} (median over interleaved steps)")
    return "\n".join(lines + ["", format_memory(result["summary"], names)])
