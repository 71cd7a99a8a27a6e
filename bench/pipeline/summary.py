"""Summarizing ``bench/pipeline/run.py``'s per-rank records (parent process): bubbles measured and
replayed, step times, the targets (P = 2) and the table."""

import os
import statistics

from bench.pipeline.timing import QUIET_CORES
from bench.pipeline import bubbles

BUBBLE_REL, BUBBLE_ABS, STEP_SLACK = 0.10, 0.02, 1.05


def _replayed_bubble(name: str, pp_size: int, num_microbatches: int, virtual: int, per_rank_calls: list) -> float:
    """Bubble of the schedule's action lists replayed with the measured median action times."""
    costs = {}
    for calls in per_rank_calls:
        for key, seconds in calls.items():
            stage, kind = key.split(":")
            costs[(int(stage), kind)] = seconds
    last = pp_size * virtual - 1
    costs[(last, "F")] = costs.get((last, "F"), 0.0) + costs.pop((last, "loss"), 0.0)
    busy, span = bubbles.replay(bubbles.action_lists(name, pp_size, num_microbatches, virtual), pp_size * virtual,
                                costs)
    return sum(span - b for b in busy) / (len(busy) * span)


def _exact_replay(name: str, pp_size: int, num_microbatches: int, virtual: int, steps: list) -> list[float]:
    """Per step: the bubble of the schedule's action lists replayed with that step's measured
    time of every action and no time between actions. What is left of the measured bubble
    is the runtime's (communication, Python between actions)."""
    actions = bubbles.action_lists(name, pp_size, num_microbatches, virtual)
    fractions = []
    for step in steps:
        costs = {}
        for rank in step:
            for key, seconds in rank[4].items():
                stage, kind, microbatch = key.split(":")
                costs[(int(stage), kind, int(microbatch))] = seconds
        busy, span = bubbles.replay(actions, pp_size * virtual, costs)
        fractions.append(sum(span - b for b in busy) / (len(busy) * span))
    return fractions


def _summarize_impl(name: str, pp_size: int, num_microbatches: int, virtual: int, impl: str,
                    per_rank: list[dict]) -> dict:
    steps = [[r["timed"][impl][i] for r in per_rank] for i in range(len(per_rank[0]["timed"][impl]))]
    step_s = [max(rank[0] for rank in step) for step in steps]  # the slowest rank's wall time
    rank_bubbles = [statistics.median(1 - step[r][1] / wall for step, wall in zip(steps, step_s))
                    for r in range(pp_size)]
    # other processes' CPU use during the step, in cores: the machine's minus this run's ranks'
    foreign = [max(0.0, (step[0][3] - sum(rank[2] for rank in step)) / wall) for step, wall in zip(steps, step_s)]
    exact = _exact_replay(name, pp_size, num_microbatches, virtual, steps)
    return dict(
        step_s=statistics.median(step_s), step_s_all=step_s,
        bubble=statistics.mean(rank_bubbles), bubble_per_rank=rank_bubbles,
        replay=_replayed_bubble(name, pp_size, num_microbatches, virtual, [r["calls"][impl] for r in per_rank]),
        replay_cpu=_replayed_bubble(name, pp_size, num_microbatches, virtual, [r["cpu"][impl] for r in per_rank]),
        exact_replay=statistics.median(exact), exact_replay_all=exact,
        cpu_s=statistics.median(max(rank[2] for rank in step) for step in steps),
        foreign_cores=statistics.median(foreign), foreign_cores_all=foreign,
        first_step_s=max(r["first_step_s"][impl] for r in per_rank),
        action_ms={k: 1e3 * v for r in per_rank for k, v in sorted(r["calls"][impl].items())},
        action_cpu_ms={k: 1e3 * v for r in per_rank for k, v in sorted(r["cpu"][impl].items())},
    )


def summarize(name: str, pp_size: int, num_microbatches: int, virtual: int, per_rank: list[dict]) -> dict:
    row = dict(schedule=name, pp=pp_size, microbatches=num_microbatches, virtual=virtual,
               oversubscribed=pp_size > (os.cpu_count() or 1),
               theory=bubbles.theoretical_bubble_fraction(name, pp_size, num_microbatches, virtual),
               partition_s=max(r["partition_s"] for r in per_rank),
               quiet_wait_s=per_rank[0]["quiet_wait_s"])
    # the same model: the first step's loss (on the last stage's rank) agrees
    (losses,) = [r["first_loss"] for r in per_rank if r["first_loss"]["ours"] is not None]
    row["loss"] = losses
    assert abs(losses["ours"] - losses["hand"]) <= 1e-4 * abs(losses["hand"]), losses
    for impl in ("ours", "hand"):
        row[impl] = _summarize_impl(name, pp_size, num_microbatches, virtual, impl, per_rank)
    row["step_ratio"] = row["ours"]["step_s"] / row["hand"]["step_s"]
    row["cpu_ratio"] = row["ours"]["cpu_s"] / row["hand"]["cpu_s"]
    row["noisy"] = max(row["ours"]["foreign_cores"], row["hand"]["foreign_cores"]) >= QUIET_CORES
    if not row["oversubscribed"]:
        tolerance = max(BUBBLE_REL * row["theory"], BUBBLE_ABS)
        row["bubble_ok"] = abs(row["ours"]["bubble"] - row["theory"]) <= tolerance
        # would a runtime with no time between actions have met it, given these action times?
        row["exact_replay_ok"] = abs(row["ours"]["exact_replay"] - row["theory"]) <= tolerance
        row["step_ok"] = row["step_ratio"] <= STEP_SLACK
    return row


def format_rows(rows: list[dict]) -> str:
    cols = (f"{'P':>2} {'M':>2} {'V':>1} {'schedule':<23} {'theory':>6} {'ours':>6} {'replay':>6} {'exact':>6} "
            f"{'hand':>6} "
            f"{'ours s':>6} {'hand s':>6} {'ratio':>5} {'cpu':>5} {'other':>5} {'part s':>6}  targets")
    lines = [cols, "-" * len(cols)]
    for r in rows:
        if r["oversubscribed"]:
            verdict = "oversubscribed, no target"
        else:
            verdict = f"bubble {'ok' if r['bubble_ok'] else 'MISS'}, step {'ok' if r['step_ok'] else 'MISS'}"
            if not r["bubble_ok"]:
                verdict += f" (exact replay {'ok' if r['exact_replay_ok'] else 'MISS'})"
        if r["noisy"]:
            verdict += " (noisy)"
        other = max(r["ours"]["foreign_cores"], r["hand"]["foreign_cores"])
        lines.append(
            f"{r['pp']:>2} {r['microbatches']:>2} {r['virtual']:>1} {r['schedule']:<23} {r['theory']:>6.1%} "
            f"{r['ours']['bubble']:>6.1%} {r['ours']['replay']:>6.1%} {r['ours']['exact_replay']:>6.1%} "
            f"{r['hand']['bubble']:>6.1%} "
            f"{r['ours']['step_s']:>6.3f} {r['hand']['step_s']:>6.3f} {r['step_ratio']:>5.2f} {r['cpu_ratio']:>5.2f} "
            f"{other:>5.2f} {r['partition_s']:>6.2f}  {verdict}")
    return "\n".join(lines)


LEGEND = """theory: bubble fraction of the schedule (see the module docstring); ours/hand: measured bubble;
replay: ours' action lists replayed with its median action times per stage; exact: replayed per
step with that step's time of every action and nothing between actions (median over steps), the
bubble a runtime without overhead would measure; "exact replay MISS": the action times alone
miss the target; ours s/hand s: median step time; ratio: ours/hand step time; cpu: ours/hand CPU
seconds per step (slowest rank); other: cores used by other processes during the steps (median;
noisy at >= {quiet}); part s: time to partition (nxd_hf.parallelize)."""
