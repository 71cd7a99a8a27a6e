"""tests/unit/: in-process tests. tests/distributed/: tests that start processes (gloo ranks,
torchrun, a subprocess). A test file holds its own cases (the functions its ranks run);
what several files share lives in tests/support/ and imports as ``support.<module>``, in pytest
and in every spawned rank.

``ranks2``/``ranks4``/``ranks8``: a pool of live gloo ranks (``nxd_hf.testing.pool``) on which a
test runs its case function, ``ranks4.run(check_x, ...)``: one pytest item per case without a
spawn per case. One pool lives at a time in a pytest process (each rank is a process holding torch;
``make test`` runs two pytest workers, each with its own pools).
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


# Without a GPU, nxd_hf's Triton kernels (the fused loss's softmax) run in Triton's interpreter on
# CPU tensors. Triton reads the switch when its language module is imported, which the forkserver's
# preloads (torch, transformers) may do: it is set before any rank starts, and never on a GPU,
# whose lane tests the compiled kernels.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _support_modules() -> list[str]:
    folder = os.path.join(TESTS, "support")
    return sorted(f"support.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")


# A rank unpickling its case function imports the case's module, which imports pytest and the
# shared builders: imported once in the forkserver instead of in every rank it starts.
from nxd_hf.testing import preload  # noqa: E402  (after sys.path holds the test folders)

preload("pytest", *_support_modules())


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, every test module) moves to the collector's
    permanent generation: tests that call ``Trainer.train`` (a ``gc.collect()`` each) then do not
    traverse it every time (as ``nxd_hf.testing.gc_freeze`` does for the ranks)."""
    import gc

    gc.freeze()


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


_POOL_ORDER = {"no_rank_pool": -1, "ranks2": 2, "ranks4": 4, "ranks8": 8}


def _pool_key(item):
    names = getattr(item, "fixturenames", ())
    keys = [key for name, key in _POOL_ORDER.items() if name in names]
    return keys[0] if keys else None


def _chain(files: list[list]) -> list:
    """``files``: each file's tests as [(world size or -1, item)], in order. Each file's tests are
    grouped by world size (stable: tests on one pool keep their order; -1, their own processes,
    first), and the files chained greedily so that a file begins on the pool the one before it
    ended with (a file's groups may run in descending order for that)."""
    todo = []
    for tests in files:
        groups = {}
        for key, item in tests:
            groups.setdefault(key, []).append(item)
        own = groups.pop(-1, [])
        todo.append((own, sorted(groups.items())))
    out, pool = [], None
    while todo:
        pick = next((f for f in todo if [k for k, _ in f[1]] == [pool]), None) or \
            next((f for f in todo if f[1] and pool in (f[1][0][0], f[1][-1][0])), None) or \
            min(todo, key=lambda f: (bool(f[1]), f[1][0][0] if f[1] else 0))
        todo.remove(pick)
        own, groups = pick
        if groups and groups[-1][0] == pool and groups[0][0] != pool:
            groups = groups[::-1]
        out += own + [item for _, group in groups for item in group]
        pool = groups[-1][0] if groups else (None if own else pool)
    return out


def pytest_collection_modifyitems(config, items):
    """Fewer rank-pool switches (one pool lives at a time: a test asking for another world size
    ends the pool and starts one) in tests/distributed/: see ``_chain``. A test that uses no pool
    stays behind the one before it. Other folders keep their order."""
    distributed = os.path.join(TESTS, "distributed") + os.sep
    where = [i for i, item in enumerate(items) if str(item.path).startswith(distributed)]
    if not where or where[-1] - where[0] + 1 != len(where):
        return  # none, or interleaved with other files: the order as collected
    files = {}
    for item in items[where[0]:where[-1] + 1]:
        tests = files.setdefault(str(item.path), [])
        key = _pool_key(item)
        tests.append((tests[-1][0] if key is None and tests else -1 if key is None else key, item))
    items[where[0]:where[-1] + 1] = _chain(list(files.values()))
