"""Whether a run of ``bench/train_step`` was quiet enough for its wall-clock ratios.

The question is whether other processes took CPU from the run. The 1-min load average cannot
answer it on its own: it counts the run's own threads too (the RSS sampler of every rank,
torchrun's agent, the workers importing at launch), and a 2-rank run alone on this 2-core
machine reads 2.0-2.5. So the judgement is on the CPU time of everything else: the machine's
busy time from /proc/stat minus this process tree's own (``os.times``, children included once
they have been waited for), as a share of the cores the run uses; and on the steal time. The
load average is still sampled and recorded beside. Tokens per CPU-second need no judgement
(they count only the run's own CPU time), so they are always recorded."""

import os
import threading

FOREIGN_LIMIT = 0.05  # other processes' CPU, as a share of the cores the run uses
STEAL_LIMIT = 0.05


def cpu_times() -> tuple[int, int, int]:
    """(steal, busy, total) jiffies of all CPUs since boot (busy: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    fields += [0] * (8 - len(fields))
    total = sum(fields)
    return fields[7], total - fields[3] - fields[4], total


def own_cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have been waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadWatch:
    """Samples the 1-min load average every ``interval_s`` while open; steal, the machine's busy
    time and this process tree's CPU time over the whole span."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s, self.loads = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = self._end = None

    def _run(self) -> None:
        while True:
            self.loads.append(os.getloadavg()[0])
            if self._stop.wait(self.interval_s):
                return

    @staticmethod
    def _read() -> tuple:
        return (*cpu_times(), own_cpu_seconds(), os.times().elapsed)

    def __enter__(self) -> "LoadWatch":
        self._start = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._end = self._read()

    def result(self) -> dict:
        end = self._end or self._read()  # so far, while open
        steal, busy, total, own, wall = (b - a for a, b in zip(self._start, end))
        tick = os.sysconf("SC_CLK_TCK")
        foreign = max(busy / tick - own, 0.0)
        return dict(max_load=max(self.loads), median_load=sorted(self.loads)[len(self.loads) // 2],
                    steal_fraction=steal / max(total, 1), foreign_cpu_seconds=foreign,
                    foreign_cores=foreign / max(wall, 1e-9), own_cpu_seconds=own, wall_seconds=wall)


def verdict(watch: dict, cores_used: int, cpus: int) -> dict:
    """Quiet when other processes used at most ``FOREIGN_LIMIT`` of the cores the run uses and
    steal stayed under ``STEAL_LIMIT``; else the reasons."""
    allowed = min(cores_used, cpus)
    reasons = []
    if watch["foreign_cores"] > FOREIGN_LIMIT * allowed:
        reasons.append(f"other processes used {watch['foreign_cores']:.2f} cores on average "
                       f"(> {FOREIGN_LIMIT:.0%} of the {allowed} cores this run uses; 1-min load average up to "
                       f"{watch['max_load']:.1f})")
    if watch["steal_fraction"] > STEAL_LIMIT:
        reasons.append(f"steal time {100 * watch['steal_fraction']:.0f}% > {STEAL_LIMIT:.0%} (the hypervisor took "
                       "the CPUs)")
    return dict(quiet=not reasons, reasons=reasons, cores_used=allowed, **watch)
