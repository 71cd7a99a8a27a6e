"""nnScaler's ``launch_torchrun`` runs its worker on the session's gloo rank pool (tests/conftest.py):
one pool per world size, no torchrun spawn per test."""

import pytest

from . import launch_torchrun


@pytest.fixture(autouse=True)
def _nnscaler_rank_pools(rank_pools):
    launch_torchrun.POOLS = rank_pools
    yield
    launch_torchrun.POOLS = None


# Vendored for its helpers (test_checkpoint_shared and test_checkpoint_dedup import them), not
# collected: its tests read nnScaler internals that the reference document does not describe (the
# CUBE_EXTRA_STATE key and ExtraState class, ParallelModule.reducers, the "infer_pipe" scheduler,
# the merge log of nnscaler.runtime.module): docs/nnscaler.md lists it.
collect_ignore = ["parallel_module/test_checkpoint.py"]

# Known differences from nnScaler (docs/nnscaler.md), as xfails. Not run: the failing case raises on a
# rank, which ends its rank pool, and the next test would pay a new one.
_DATA_IN_A_UNIT = (
    "nnScaler's 'data' policy with plan_ngpus=2 splits each batch inside a unit of 2 ranks; nxd_hf refuses "
    "it (a ValueError: use units, plan_ngpus=1)")
KNOWN_DIFFERENCES = {
    "parallel_module/test_reducer_hook.py::test_hook_dp_gpu2": _DATA_IN_A_UNIT,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.nodeid.split("conformance/nnscaler/", 1)[-1]
        if rel in KNOWN_DIFFERENCES:
            item.add_marker(pytest.mark.xfail(strict=True, run=False, reason=KNOWN_DIFFERENCES[rel]))
