"""tests/unit/: in-process tests. tests/distributed/: tests that start processes (gloo ranks,
torchrun, a subprocess). Helper modules shared by both (``hf_parity``, ``*_cases``) live here,
beside this file, and import by their bare names, in pytest and in every spawned rank.

``ranks2``/``ranks4``/``ranks8``: a pool of live gloo ranks (``nxd_hf.testing.pool``) on which a
test runs its case function, ``ranks4.run(check_x, ...)``: one pytest item per case without a
spawn per case. One pool lives at a time (each rank is a process holding torch).
"""

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# Ranks are started by a forkserver, which must be able to import the test modules: it takes
# sys.path as it is when the first rank starts, so every test folder is on it from the start.
for folder in (os.path.join(TESTS, "distributed"), os.path.join(TESTS, "unit"), TESTS):
    if folder not in sys.path:
        sys.path.insert(0, folder)


@pytest.fixture(scope="session")
def rank_pools():
    from nxd_hf.testing.pool import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture
def ranks2(rank_pools):
    return rank_pools.get(2)


@pytest.fixture
def ranks4(rank_pools):
    return rank_pools.get(4)


@pytest.fixture
def ranks8(rank_pools):
    return rank_pools.get(8)


@pytest.fixture
def no_rank_pool(rank_pools):
    """For a test that starts its own processes (run_distributed, torchrun): the pool's ranks
    are ended first, so the two sets of processes do not share the machine."""
    rank_pools.close()
