"""The memory side of ``bench/train_step``: the floor, and the transients between the steady
state and the peak, itemized by phase from the RssAnon trace of each rank (``memtrace``)."""

from bench.train_step.memtrace import itemize

MiB = 2**20
PARAM_BYTES, GRAD_BYTES, ADAMW_BYTES = 4, 4, 8  # fp32 parameter, gradient, AdamW's two moments
TARGET = 1.15  # the target: peak <= 1.15 x floor


def floor_bytes(num_params: int, *, tp: int, dp: int = 1, zero1: bool = False, bare: int) -> float:
    """(parameters + gradients + AdamW state) / tp + the bare process; ZeRO-1 divides the AdamW
    state by dp as well. (TP-replicated norms are counted / tp too: < 0.1% of these models.)"""
    adamw = ADAMW_BYTES / dp if zero1 else ADAMW_BYTES
    return num_params * (PARAM_BYTES + GRAD_BYTES + adamw) / tp + bare


def rank_memory(rank: dict, num_params: int, *, tp: int, dp: int, zero1: bool) -> dict:
    """One rank: the floor on RssAnon, the first and the last traced step itemized, the peak."""
    steps = itemize(rank["memtrace"]["phases"])
    floor = floor_bytes(num_params, tp=tp, dp=dp, zero1=zero1, bare=rank["bare_anon"])
    peak = max(s["peak"] for s in steps)
    return dict(floor_anon=floor, peak_anon=peak, peak_anon_over_floor=peak / floor, first_step=steps[0],
                last_step=steps[-1], samples=rank["memtrace"]["samples"], bare_anon=rank["bare_anon"])


def worst_rank_memory(ranks: list[dict], num_params: int, **layout) -> dict:
    per_rank = [rank_memory(r, num_params, **layout) for r in ranks]
    return max(per_rank, key=lambda m: m["peak_anon_over_floor"])


def format_memory(summary: dict, names: dict) -> str:
    """The itemized table: per case (worst rank, last repeat) the step's RssAnon at its start
    and per phase the peak above it, for the first step and the last (steady) one."""
    lines = ["RssAnon per rank (MiB, worst rank); floor = (params + grads + AdamW [/dp with ZeRO-1]) / tp + bare "
             "RssAnon; per phase: its peak minus the RssAnon at the step's start",
             "| case | floor | peak | peak/floor | step | start | forward | backward | clip | optimizer | zero_grad "
             "| end of step |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, row in summary.items():
        memory = row.get("memory")
        if not memory:
            continue
        for label in ("first_step", "last_step"):
            step = memory[label]
            phases = [step["phases"].get(p) for p in ("forward", "backward", "clip", "optimizer", "zero_grad")]
            cells = " | ".join("-" if v is None else f"+{v / MiB:.0f}" for v in phases)
            head = (f"| {names.get(case, case)} | {memory['floor_anon'] / MiB:.0f} | {memory['peak_anon'] / MiB:.0f} | "
                    f"{memory['peak_anon_over_floor']:.2f} ({'met' if memory['peak_anon_over_floor'] <= TARGET else 'NOT met'})"
                    if label == "first_step" else "| | | |")
            lines.append(f"{head} | {label.split('_')[0]} ({step['step']}) | {step['begin'] / MiB:.0f} | {cells} | "
                         f"{step.get('end', step['begin']) / MiB:.0f} |")
    return "\n".join(lines)
