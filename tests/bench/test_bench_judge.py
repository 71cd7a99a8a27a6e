"""``bench/train_step`` judges a run quiet by the CPU other processes took,
not by the load average (which counts the run's own threads)."""

import subprocess
import sys
import time

from bench.train_step.judge import LoadWatch, verdict


def _watch(**values):
    return dict(dict(max_load=2.4, median_load=2.1, steal_fraction=0.0, foreign_cpu_seconds=0.0, foreign_cores=0.0,
                     own_cpu_seconds=80.0, wall_seconds=40.0), **values)


def test_a_load_average_above_the_cores_from_the_run_itself_is_quiet():
    assert verdict(_watch(foreign_cores=0.09), cores_used=2, cpus=2)["quiet"]


def test_other_processes_cpu_or_steal_withholds_the_ratios():
    busy = verdict(_watch(foreign_cores=0.11), cores_used=2, cpus=2)
    assert not busy["quiet"] and "other processes used 0.11 cores" in busy["reasons"][0]
    stolen = verdict(_watch(steal_fraction=0.2), cores_used=2, cpus=2)
    assert not stolen["quiet"] and "steal time 20%" in stolen["reasons"][0]
    assert len(verdict(_watch(foreign_cores=0.5, steal_fraction=0.2), cores_used=1, cpus=2)["reasons"]) == 2


SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"


def test_the_runs_own_children_count_as_its_own_cpu():
    with LoadWatch(interval_s=0.1) as watch:
        subprocess.run([sys.executable, "-c", SPIN], check=True)
    result = watch.result()
    assert result["own_cpu_seconds"] >= 0.6, result  # the child's busy loop, once waited for
    assert result["wall_seconds"] >= 0.6


def test_a_process_outside_the_runs_tree_counts_as_foreign():
    """A child not yet waited for is not in ``os.times``: its busy loop is another process's CPU."""
    with LoadWatch(interval_s=0.1) as watch:
        spinner = subprocess.Popen([sys.executable, "-c", SPIN])
        while _state(spinner.pid) != "Z":  # exited, not reaped (reaping would add it to our own time)
            time.sleep(0.02)
        result = watch.result()
    spinner.wait()
    assert result["foreign_cpu_seconds"] >= 0.5, result
    assert result["own_cpu_seconds"] < result["foreign_cpu_seconds"], result


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
