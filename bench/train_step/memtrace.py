"""RssAnon sampled at fine grain through training steps, by phase, for ``bench/train_step``.

A thread reads ``/proc/self/status`` every ``interval_s`` (torch's CPU kernels release the GIL,
so it samples inside them). The code being measured calls ``mark(phase)`` at each boundary
(forward, backward, clip, optimizer, zero_grad, ...); each phase of each step records RssAnon
at its start and its peak, so a transient is itemized as (peak in the phase - RssAnon when the
step began), and the steady state is RssAnon at the end of the step.

Only the standard library: the worker imports it before torch."""

import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class MemTrace:
    """``mark(phase)`` opens a phase (``step`` increments on ``phase == "forward"``);
    ``phases`` is a list of dicts: step, phase, start (RssAnon at the mark), peak, seconds."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.phases: list[dict] = []
        self.samples = 0
        self.step = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, phase: str) -> None:
        value = rss_anon()
        with self._lock:
            if phase == "forward":
                self.step += 1
            now = time.perf_counter()
            if self.phases:
                last = self.phases[-1]
                last["peak"] = max(last["peak"], value)
                last["seconds"] = now - last["t0"]
            self.phases.append(dict(step=self.step, phase=phase, start=value, peak=value, t0=now, seconds=0.0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            value = rss_anon()
            with self._lock:
                if self.phases:
                    self.phases[-1]["peak"] = max(self.phases[-1]["peak"], value)
                self.samples += 1

    def __enter__(self) -> "MemTrace":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.mark("end")
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        return dict(samples=self.samples, interval_s=self.interval_s,
                    phases=[{k: v for k, v in p.items() if k != "t0"} for p in self.phases])


def itemize(phases: list[dict]) -> list[dict]:
    """Per step: RssAnon when it began, when it ended (the next step's start), and per phase
    the transient = peak - start of step (a phase seen twice in a step keeps its worst)."""
    steps: dict[int, dict] = {}
    for p in phases:
        if p["step"] < 0 or p["phase"] == "end":
            if p["phase"] == "end" and p["step"] in steps:
                steps[p["step"]]["end"] = p["start"]
            continue
        row = steps.setdefault(p["step"], dict(step=p["step"], begin=p["start"], phases={}))
        row["phases"][p["phase"]] = max(row["phases"].get(p["phase"], -2**62), p["peak"] - row["begin"])
    ordered = [steps[k] for k in sorted(steps)]
    for row, following in zip(ordered, ordered[1:]):
        row["end"] = following["begin"]
    for row in ordered:
        row["peak"] = row["begin"] + max(row["phases"].values())
    return ordered
