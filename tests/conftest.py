"""tests/unit/: in-process tests. tests/distributed/: tests that start processes (gloo ranks,
torchrun, a subprocess). A test file holds its own cases (the functions its ranks run);
what several files share lives in tests/support/ and imports as ``support.<module>``, in pytest
and in every spawned rank.

``ranks2``/``ranks4``/``ranks8``: a pool of live gloo ranks (``nxd_hf.testing.pool``) on which a
test runs its case function, ``ranks4.run(check_x, ...)``: one pytest item per case without a
spawn per case. One pool lives at a time (each rank is a process holding torch).
"""

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_folders():
    """tests/ (for ``support``) and every folder of test modules below it that is not a package:
    pytest imports those modules by their bare names (so the names are unique across folders)."""
    yield TESTS
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not os.path.exists(os.path.join(folder, d, "__init__.py")))
        if folder != TESTS and any(f.startswith("test_") and f.endswith(".py") for f in files):
            yield folder


# Ranks are started by a forkserver, which must be able to import the test modules (a case
# function is sent to a rank by its module's name): it takes sys.path as it is when the first
# rank starts, so every test folder is on it from the start.
for _folder in _test_folders():
    if _folder not in sys.path:
        sys.path.insert(0, _folder)


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
