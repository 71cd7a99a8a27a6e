"""nxd_hf.testing.pool.RankPool, the ranks behind one pytest item per case: results per rank from
processes that stay alive between cases; a failing, hanging or dying rank is reported (never a
hang) and the next case runs on fresh ranks; parallel_state is reset between cases unless a case
asks for the layout the previous one left."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from nxd_hf import parallel_state
from nxd_hf.testing import DistributedTestError
from nxd_hf.testing.pool import RankPool


def rank_sum_and_pid(x):
    t = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(t)
    return float(t), os.getpid()


def fails_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def hangs_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(600)


def dies_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def breaks_the_group():
    dist.destroy_process_group()


def layout_state():
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_size(), id(parallel_state.get_tensor_model_parallel_group())


@pytest.fixture
def pool():
    with RankPool(2, timeout_s=15) as pool:  # 5 s timed out on trivial cases under a load of 15 on 2 cores
        yield pool


def _pids(pool):
    return [pid for _, pid in pool.run(rank_sum_and_pid, 1)]


def test_results_per_rank_from_ranks_that_stay_alive(pool):
    assert [value for value, _ in pool.run(rank_sum_and_pid, 1)] == [3.0, 3.0]
    first = _pids(pool)
    assert _pids(pool) == first


@pytest.mark.parametrize("case,message", [
    (fails_on_rank1, "rank 1 failed:(.|\n)*ValueError: boom on rank 1"),
    (hangs_on_rank0, r"timed out after 4s waiting for ranks \[0"),
    (dies_on_rank1, "rank 1 died with exit code 3"),
])
def test_a_failing_hanging_or_dying_rank_is_reported_and_the_pool_restarts(pool, case, message):
    before = _pids(pool)
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=message):
        # the hang is cut at the run's own timeout (the pool's 15 s would only make the test wait)
        pool.run(case, timeout_s=4 if case is hangs_on_rank0 else None)
    assert time.monotonic() - start < 45
    after = _pids(pool)
    assert not set(after) & set(before)


def test_a_case_that_leaves_the_group_unusable_passes_and_the_pool_restarts(pool):
    before = _pids(pool)
    assert pool.run(breaks_the_group) == [None, None]
    assert not set(_pids(pool)) & set(before)


def test_parallel_state_reset_between_cases_unless_the_layout_is_asked_again(pool):
    (tp, group), _ = pool.run(layout_state, model_parallel=(2, 1))
    assert tp == 2
    assert pool.run(layout_state, model_parallel=(2, 1))[0] == (2, group)  # kept
    assert pool.run(layout_state) == [None, None]  # reset
    assert pool.run(layout_state, model_parallel=(1, 1))[0][0] == 1


def test_a_rank_whose_pool_owner_is_gone_stops_waiting_for_cases():
    """A killed test run (its pytest gone) does not leave its ranks waiting for cases forever."""
    import queue
    import subprocess

    from nxd_hf.testing.pool import _next_task

    gone = subprocess.Popen(["true"])
    gone.wait()
    tasks = queue.Queue()
    assert _next_task(tasks, gone.pid, poll_s=0.05) is None
    tasks.put("case")
    assert _next_task(tasks, os.getpid(), poll_s=0.05) == "case"
