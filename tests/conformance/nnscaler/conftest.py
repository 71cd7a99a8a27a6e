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

# Known differences from nnScaler (docs/nnscaler.md), as xfails. Not run by default: each failure ends
# its rank pool and the next test pays a new one (about 7 minutes of CI for the nine on 2 cores);
# `pytest tests/conformance --runxfail` runs them, and the marker goes once one passes.
_UNUSED_PARAMETERS = (
    "nnScaler's ParallelModule drops the parameters its traced graph does not use (unused_fc*: absent "
    "from its state dict, so from the merged one); nxd_hf keeps every parameter of the module")
_PIPELINE_PARAM_GROUPS = (
    "the merged optimizer state's param_groups list the parameters the pipelined module holds; nnScaler "
    "lists every parameter index of the original module, also those of linear0_unused, which neither "
    "library's pipelined module holds (it is unused)")
_ZERO_HOOKS = (
    "under ZeRO-1 a post hook sees this rank's reduced slice, not the buffer that .grad views (nnScaler's "
    "bucket): the pre hook's grad.div_(2) stays on .grad, so clip_gnorm, which reads .grad, gives half "
    "the norm of the run without hooks (the weights are equal)")
KNOWN_DIFFERENCES = {


}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.nodeid.split("conformance/nnscaler/", 1)[-1]
        if rel in KNOWN_DIFFERENCES:
            item.add_marker(pytest.mark.xfail(strict=True, run=False, reason=KNOWN_DIFFERENCES[rel]))
