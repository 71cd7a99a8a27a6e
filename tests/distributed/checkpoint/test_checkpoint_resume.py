"""Exact resume and resharding across process lifetimes.

- Exact resume, tp=2 x dp=2 with ZeRO-1, attention dropout and an LR schedule: N steps, save,
  every process ends; new processes load and run M steps = the N+M uninterrupted steps, bit
  for bit (losses, parameters, Adam moments and steps).
- Resharding (2,1,2)+ZeRO-1 -> (4,2,1)+ZeRO-1 -> (2,1,2)+ZeRO-1: each load reproduces the saved
  model and optimizer state bit for bit, and two further steps match the saving run's (within
  the parity tolerance: another TP size sums in another order).
"""

import os

import pytest
import torch

from support import ckpt as C
from support import hf_parity
import nxd_hf
from nxd_hf.parallel_layers.random import model_parallel_manual_seed
from nxd_hf.testing import run_distributed

pytestmark = pytest.mark.usefixtures("no_rank_pool")  # their own processes only

N, M = 3, 3
DROPOUT = 0.1
RESUME = dict(tp=2, zero1=True, dropout=DROPOUT)


def _save_expected(root, name, value):
    if torch.distributed.get_rank() == 0:
        torch.save(value, os.path.join(root, f"{name}.pt"))


def _continue_and_save(root, name, model, optimizer, scheduler, start):
    """Save at ``start``, then record the snapshot and the next two steps' losses."""
    nxd_hf.save_checkpoint(os.path.join(root, name), model=model, optimizer=optimizer, scheduler=scheduler)
    snapshot = C.snapshot(model, optimizer)
    _save_expected(root, name, {"snapshot": snapshot, "losses": C.train(model, optimizer, scheduler, 2, start=start)})


def _load_and_check(root, name, model, optimizer, scheduler, start):
    nxd_hf.load_checkpoint(os.path.join(root, name), model=model, optimizer=optimizer, scheduler=scheduler)
    expected = torch.load(os.path.join(root, f"{name}.pt"))
    snapshot = C.snapshot(model, optimizer)
    if snapshot is not None:
        C.assert_snapshots_equal(expected["snapshot"], snapshot)
    losses = C.train(model, optimizer, scheduler, 2, start=start)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]), **hf_parity.TOL)


def first_processes(root):
    model, optimizer, scheduler, _ = C.build(**RESUME)
    model_parallel_manual_seed(1234)
    losses = C.train(model, optimizer, scheduler, N + M)
    _save_expected(root, "uninterrupted", {"losses": losses, "snapshot": C.snapshot(model, optimizer)})
    model, optimizer, scheduler, _ = C.build(**RESUME)
    model_parallel_manual_seed(1234)
    C.train(model, optimizer, scheduler, N)
    nxd_hf.save_checkpoint(os.path.join(root, "resume"), model=model, optimizer=optimizer, scheduler=scheduler)
    # resharding, leg 1: saved at (2,1,2) + ZeRO-1
    model, optimizer, scheduler, _ = C.build(tp=2, zero1=True)
    C.train(model, optimizer, scheduler, 2)
    _continue_and_save(root, "at_212", model, optimizer, scheduler, start=2)


def world8(root):
    """(2,1,2)+ZeRO-1 -> (4,2,1)+ZeRO-1, trained two steps there and saved."""
    model, optimizer, scheduler, _ = C.build(tp=4, pp=2, zero1=True, seed=5)
    _load_and_check(root, "at_212", model, optimizer, scheduler, start=2)
    _continue_and_save(root, "at_421", model, optimizer, scheduler, start=4)


def second_processes(root):
    model, optimizer, scheduler, _ = C.build(**RESUME, seed=11)
    nxd_hf.load_checkpoint(os.path.join(root, "resume"), model=model, optimizer=optimizer, scheduler=scheduler)
    losses = C.train(model, optimizer, scheduler, M, start=N)
    snapshot = C.snapshot(model, optimizer)
    expected = torch.load(os.path.join(root, "uninterrupted.pt"))
    assert losses == expected["losses"][N:], (losses, expected["losses"])
    if snapshot is not None:
        C.assert_snapshots_equal(expected["snapshot"], snapshot, exact=True)
    # resharding, leg 3: (4,2,1) -> (2,1,2)
    model, optimizer, scheduler, _ = C.build(tp=2, zero1=True, seed=6)
    _load_and_check(root, "at_421", model, optimizer, scheduler, start=4)


def test_exact_resume_and_resharding(tmp_path):
    run_distributed(first_processes, 4, str(tmp_path), timeout_s=900)
    run_distributed(world8, 8, str(tmp_path), timeout_s=900)
    run_distributed(second_processes, 4, str(tmp_path), timeout_s=900)
