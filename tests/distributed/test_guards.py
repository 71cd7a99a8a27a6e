"""The one way every rank raises the same error: ``failures_on_every_rank`` and ``fail_together``
built on it, with failures on some ranks only (one spawn of 4 ranks)."""

import pytest
import torch

from nxd_hf import backend
from nxd_hf.guards.fail_together import fail_together, failures_on_every_rank
from nxd_hf.testing import run_distributed


def guard_cases() -> bool:
    rank = backend.rank()
    assert failures_on_every_rank(None) == {}
    problem = {1: "rank one: bad", 3: "rank three: worse \u00e9\nsecond line", 2: None, 0: None}[rank]
    assert failures_on_every_rank(problem) == {1: "rank one: bad", 3: "rank three: worse \u00e9\nsecond line"}
    assert failures_on_every_rank("" if rank == 2 else None) == {2: ""}  # an empty message still fails
    with pytest.raises(ValueError, match=r"^setup step failed on rank 2 \(every rank stops here\): KeyError: 'x'$"):
        with fail_together("setup step"):
            if rank >= 2:
                raise KeyError("x")
    with fail_together("a step that works"):
        pass
    flag = torch.ones(1)
    backend.all_reduce(flag, None)  # the ranks are still in step
    assert int(flag) == 4
    return True


def test_failures_reach_every_rank_world4():
    assert run_distributed(guard_cases, 4) == [True] * 4


def test_single_process_keeps_the_error():
    assert failures_on_every_rank("alone") == {0: "alone"}
    with pytest.raises(KeyError):
        with fail_together("setup step"):
            raise KeyError("x")
