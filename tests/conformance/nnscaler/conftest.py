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
