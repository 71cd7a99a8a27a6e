"""nnScaler's ``launch_torchrun`` runs its worker on the session's gloo rank pool (tests/conftest.py):
one pool per world size, no torchrun spawn per test."""

import pytest

from . import launch_torchrun


@pytest.fixture(autouse=True)
def _nnscaler_rank_pools(rank_pools):
    launch_torchrun.POOLS = rank_pools
    yield
    launch_torchrun.POOLS = None
