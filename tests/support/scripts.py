"""The examples run as ``torchrun`` starts them, on the ranks of a pool (less the launch, which
the few tests that start ``torchrun`` itself cover), and what they print."""

import contextlib
import io
import os
import re
import runpy
import sys
from unittest import mock

from support.paths import REPO


def _script_on_rank(script: str, args: list[str]) -> str:
    """``script`` as ``torchrun`` would start it on this rank (the pool's ranks have torchrun's
    environment: RANK, WORLD_SIZE, MASTER_ADDR...), from the repository root; the script's closing
    ``destroy_process_group`` is skipped, as the pool keeps its group. Returns what it printed."""
    out, cwd, argv, path = io.StringIO(), os.getcwd(), sys.argv, list(sys.path)
    try:
        os.chdir(REPO)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python puts the script's folder first
        with mock.patch("torch.distributed.destroy_process_group"), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    finally:
        os.chdir(cwd)
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def run_on_ranks(rank_pools, script: str, nproc: int, *args: str) -> str:
    """``torchrun --nproc_per_node nproc script *args`` on the pool's ranks; rank 0's output. The
    pool is closed after: a script leaves process-wide state (Trainer, Lightning) behind."""
    try:
        return rank_pools.get(nproc).run(_script_on_rank, script, list(args), timeout_s=600)[0]
    finally:
        rank_pools.close()


def loss_fell(out: str) -> tuple[float, float]:
    """The first and last loss of an example's "loss fell from X to Y" line; asserts the last is lower."""
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", out).groups())
    assert last < first, out
    return first, last
