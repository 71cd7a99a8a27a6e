"""When and on what a benchmark ran: every bench script's JSON carries ``**stamp()``, and
``bench/docs_tables.py`` heads each table in ``docs/`` with it."""

import datetime
import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):  # not Linux, or an architecture whose cpuinfo names no model
        return platform.processor() or platform.machine()


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def stamp() -> dict:
    """``{"date": "2026-11-23", "machine": "2 CPUs, 24 GiB, AMD EPYC, Linux-6.18...-x86_64-with-glibc2.36"}``."""
    return {"date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPUs, {_memory_gib():.0f} GiB, {_cpu_model()}, {platform.platform()}"}
