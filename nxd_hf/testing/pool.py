"""A pool of gloo ranks kept alive across test cases: one pytest item per case, one spawn per pool.

``RankPool(world_size).run(fn, *args)`` runs ``fn`` on every rank of a process group that was set
up once, with the guarantees of ``run_distributed``: a failure on any rank raises
``DistributedTestError`` carrying that rank's traceback, and a rank that does not finish within
``timeout_s`` is killed and reported. Between cases every rank resets ``parallel_state``, except
that ``run(..., model_parallel=(tp, pp))`` runs the case on groups of that layout, created once and
kept for the next case that asks for the same (creating groups costs more than a small case); a case
that failed, timed out, killed a rank or left the process group unusable (checked by a barrier
with a timeout) ends the pool, and the next ``run`` starts a fresh one.
"""

import datetime
import itertools
import os
import queue
import traceback

import torch.distributed as dist

from nxd_hf import parallel_state
from nxd_hf.testing import _collect, _get_context, _join_or_kill, _setup_rank, DistributedTestError

_HEALTH_TIMEOUT = datetime.timedelta(seconds=30)


def _pool_rank_main(rank, world_size, port, tasks, results, process_group_backend="gloo", owner=None):
    try:
        _setup_rank(rank, world_size, port, process_group_backend)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := _next_task(tasks, owner)) is not None:
        seq, fn, args, kwargs, layout = task
        status, value = _run_case(fn, args, kwargs, layout)
        if status == "ok":
            try:
                dist.monitored_barrier(timeout=_HEALTH_TIMEOUT, wait_all_ranks=True)
            except Exception:  # the case passed, but this group cannot run the next one
                status = "broken"
        results.put((rank, "error", value) if status == "error" else (rank, "ok", (seq, value, status == "broken")))
    dist.destroy_process_group()


def _next_task(tasks, owner: int | None, poll_s: float = 5.0):
    """The next case; None once the pool is closed or the process that owns it (pytest) is gone:
    a killed test run would otherwise leave its ranks waiting for cases, on the machine, forever."""
    while True:
        try:
            return tasks.get(timeout=poll_s)
        except queue.Empty:
            if owner is not None and not _alive(owner):
                return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _has_layout(layout: tuple[int, int]) -> bool:
    return parallel_state.model_parallel_is_initialized() and layout == (
        parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size())


def _run_case(fn, args, kwargs, layout):
    """``fn`` from a reset ``parallel_state`` or on ``layout``'s groups; reset after, unless it
    left ``layout`` in place for the next case. After an error the pool ends anyway."""
    try:
        if layout is None:
            parallel_state.destroy_model_parallel()  # the previous case's layout, if it kept one
        elif not _has_layout(layout):
            parallel_state.initialize_model_parallel(*layout)
        value = fn(*args, **kwargs)
        if layout is None or not _has_layout(layout):
            parallel_state.destroy_model_parallel()
        return "ok", value
    except BaseException:  # report everything, including assertion failures
        return "error", traceback.format_exc()


class RankPool:
    """``world_size`` gloo ranks that run one case function after another (see the module doc)."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._procs, self._seq = None, itertools.count()

    def _start(self):
        ctx = _get_context()
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        process_group_backend = os.environ.get("NXD_HF_BACKEND", "gloo")  # read here: the forkserver's env is older
        self._procs = [
            ctx.Process(target=_pool_rank_main, daemon=True,
                        args=(r, self.world_size, self._store.port, self._tasks[r], self._results,
                              process_group_backend, os.getpid()))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout_s: float | None = None, model_parallel: tuple[int, int] | None = None,
            **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        ``fn`` must be importable (module level) and its arguments and results picklable.
        ``model_parallel=(tp, pp)``: ``parallel_state`` is initialized with that layout first.
        """
        if self._procs is None:
            self._start()
        seq = next(self._seq)
        for q in self._tasks:
            q.put((seq, fn, args, kwargs, model_parallel))
        outcome, errors = _collect(self._procs, self._results, timeout_s or self.timeout_s)
        if errors:
            self.close(kill=True)
            raise DistributedTestError("\n".join(errors))
        assert all(s == seq for s, _, _ in outcome.values()), "a result from another case"
        if any(broken for _, _, broken in outcome.values()):
            self.close(kill=True)
        return [outcome[r][1] for r in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        if self._procs is None:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
        _join_or_kill(self._procs, 5 if not kill else 0.5)
        self._procs = None
        del self._store

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RankPools:
    """At most one live ``RankPool`` (they hold a process per rank): asking for another world
    size closes the current pool first."""

    def __init__(self, **pool_kwargs):
        self._pool, self._kwargs = None, pool_kwargs

    def get(self, world_size: int) -> RankPool:
        if self._pool is not None and self._pool.world_size != world_size:
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = RankPool(world_size, **self._kwargs)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
