"""Whether a run of ``bench/train_step`` was quiet enough for its wall-clock ratios: the 1-min
load average and the steal time from /proc/stat, sampled through the run by a thread, against
the cores the run's processes use. Tokens per CPU-second need no such judgement (they count
only this run's own CPU time), so they are always recorded."""

import os
import threading


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


class LoadWatch:
    """Samples the 1-min load average every ``interval_s`` while open; steal over the whole span."""

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

    def __enter__(self) -> "LoadWatch":
        self._start = cpu_times()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._end = cpu_times()

    def result(self) -> dict:
        end = self._end or cpu_times()  # so far, while open
        steal, total = end[0] - self._start[0], max(end[1] - self._start[1], 1)
        return dict(max_load=max(self.loads), median_load=sorted(self.loads)[len(self.loads) // 2],
                    steal_fraction=steal / total)


def verdict(watch: dict, cores_used: int, cpus: int) -> dict:
    """Quiet when the load average never exceeded the cores the run uses (its own processes
    count: a 2-rank run on 2 cores reads ~2) and steal stayed under 5%; else the reason."""
    allowed = min(cores_used, cpus)
    reasons = []
    if watch["max_load"] > allowed:
        reasons.append(f"1-min load average reached {watch['max_load']:.1f} > the {allowed} cores this run uses "
                       "(other processes were running)")
    if watch["steal_fraction"] > 0.05:
        reasons.append(f"steal time {100 * watch['steal_fraction']:.0f}% > 5% (the hypervisor took the CPUs)")
    return dict(quiet=not reasons, reasons=reasons, cores_used=allowed, **watch)
