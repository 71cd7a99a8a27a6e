"""Pipeline bubbles of the torch schedules, counted in slots without processes.

The compute actions each rank runs, in order, come from the torch schedule itself (its
``pipeline_order``, built from stand-in stages); the idle slots come from replaying them with
their data dependencies — forward of stage s after forward of stage s-1, a stage's backward
after the next stage's backward, weight gradients after input gradients — and a fixed cost
per action. The ``None`` entries in torch's lists are only alignment hints (the runtime skips
them and waits on communication instead), so they are not counted.

Unit costs (``SLOT_COSTS``): forward = input-gradient = weight-gradient = 1 slot (the
zero-bubble paper's assumption), a full backward = 2. Under them 1F1B and GPipe idle
(P-1)(F+B) = 3(P-1) slots per rank out of 3(M+P-1), and interleaved 1F1B with V chunks per
rank 3(P-1) out of 3(VM+P-1): the closed forms (P-1)/(M+P-1) and (P-1)/(VM+P-1). The
zero-bubble schedules fill all but P-1 slots with weight gradients (out of 3VM+P-1; ZBV needs
M >= 2P-1 microbatches for that and idles 2(P-1) with M = P).
"""

from types import SimpleNamespace

from torch.distributed.pipelining.schedules import _ComputationType as C

from nxd_hf.pipeline.runtime import SCHEDULES

SLOT_COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}
"""Slots per action: F forward, B full backward, I input gradient, W weight gradient."""

_KINDS = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}
Action = tuple[int, str, int]  # (stage, kind, microbatch)


def _one_f_one_b(pp_size: int, num_microbatches: int) -> dict[int, list[Action]]:
    """The order ``Schedule1F1B._step_microbatches`` runs: min(M, P - r) forwards, then
    backward/forward pairs, then the remaining backwards. (torch's ``_get_pipeline_order`` IR
    for 1F1B numbers the last rank's microbatches 1..M, so it is not used.)"""
    order = {}
    for rank in range(pp_size):
        warmup = min(num_microbatches, pp_size - rank)
        actions = [(rank, "F", m) for m in range(warmup)]
        for m in range(num_microbatches):
            actions.append((rank, "B", m))
            if warmup + m < num_microbatches:
                actions.append((rank, "F", warmup + m))
        order[rank] = actions
    return order


def action_lists(schedule_name: str, pp_size: int, num_microbatches: int,
                 virtual_pipeline_size: int = 1) -> dict[int, list[Action]]:
    """rank -> the compute actions that rank runs, in order, for a schedule of
    ``nxd_hf.pipeline.runtime.SCHEDULES``."""
    schedule_cls, _, multi = SCHEDULES[schedule_name]
    if schedule_name == "1f1b":
        return _one_f_one_b(pp_size, num_microbatches)
    num_stages = pp_size * virtual_pipeline_size
    kwargs = dict(n_microbatches=num_microbatches, loss_fn=lambda output, target: output, scale_grads=False)
    if multi:  # the constructors read num_stages, group_size, group_rank (and submod, for ZBV)
        stages = [SimpleNamespace(num_stages=num_stages, group_size=pp_size, group_rank=0, submod=None)
                  for _ in range(virtual_pipeline_size)]
        schedule = schedule_cls(stages, **kwargs)
    else:
        schedule = schedule_cls(SimpleNamespace(num_stages=num_stages), **kwargs)
    return {rank: [(a.stage_index, _KINDS[a.computation_type], a.microbatch_index)
                   for a in actions if a is not None and a.computation_type in _KINDS]
            for rank, actions in schedule.pipeline_order.items()}


_MADE = {"F": "F", "B": "G", "I": "G", "W": "W"}  # what an action makes: activation, input grad, weight grad


def _needs(stage: int, kind: str, microbatch: int, num_stages: int) -> list[tuple]:
    """Values an action waits for: ("F", s, m) activation, ("G", s, m) input gradient of stage s."""
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if kind in ("B", "I"):
        after = [("G", stage + 1, microbatch)] if stage < num_stages - 1 else []
        return [("F", stage, microbatch), *after]
    return [("G", stage, microbatch)]  # W after this stage's I


def replay(actions: dict[int, list[Action]], num_stages: int, costs: dict = SLOT_COSTS) -> tuple[list, float]:
    """(busy time per rank, step length): each rank runs its actions in order, each as soon as
    the rank is free and its inputs exist (communication takes no time). ``costs`` maps a kind,
    a (stage, kind) pair for per-stage costs, or a (stage, kind, microbatch) action for
    per-action costs such as the measured times of one step, to its duration; the most
    specific key present wins."""
    ready, clock = {}, dict.fromkeys(actions, 0)
    busy, position = dict.fromkeys(actions, 0), dict.fromkeys(actions, 0)
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_actions in actions.items():
            while position[rank] < len(rank_actions):
                stage, kind, microbatch = rank_actions[position[rank]]
                needs = _needs(stage, kind, microbatch, num_stages)
                if any(n not in ready for n in needs):
                    break
                key = next(k for k in ((stage, kind, microbatch), (stage, kind), kind) if k in costs)
                cost = costs[key]
                clock[rank] = max([clock[rank], *(ready[n] for n in needs)]) + cost
                busy[rank] += cost
                ready[(_MADE[kind], stage, microbatch)] = clock[rank]
                position[rank] += 1
                progressed = True
    assert all(position[r] == len(a) for r, a in actions.items()), "schedule deadlocks"
    return [busy[r] for r in sorted(actions)], max(clock.values())


def idle_slots(schedule_name: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1, *,
               costs: dict[str, int] = SLOT_COSTS) -> list[int]:
    """Idle slots of every rank in one step (step length minus that rank's busy slots)."""
    num_stages = pp_size * virtual_pipeline_size
    busy, span = replay(action_lists(schedule_name, pp_size, num_microbatches, virtual_pipeline_size),
                        num_stages, costs)
    return [span - b for b in busy]


def theoretical_bubble_fraction(schedule_name: str, pp_size: int, num_microbatches: int,
                                virtual_pipeline_size: int = 1) -> float:
    """Idle share of a step per rank: (P-1)/(M+P-1) for 1F1B and GPipe, (P-1)/(VM+P-1) for
    interleaved 1F1B and looped BFS, the replayed action lists for the zero-bubble schedules."""
    p, m, v = pp_size, num_microbatches, virtual_pipeline_size
    if schedule_name in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if schedule_name in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    busy, span = replay(action_lists(schedule_name, p, m, v), p * v)
    return sum(span - b for b in busy) / (len(busy) * span)
