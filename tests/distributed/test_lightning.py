"""nxd_hf.lightning (NeuronLTModule, NxDStrategy, the progress bar and TensorBoard logger) against
plain PyTorch Lightning in one process on the same tiny Llama, data and seed: logged losses every
step, validation loss, final parameters, the logger's event file and the progress bar (one rank
writes), at tp=2, pp=2 and dp=2 with ZeRO-1; a checkpoint saved at tp=2 resumed at tp=1 x dp=2."""

import pytest

import lightning_cases


@pytest.mark.parametrize("tp, pp, zero1, log_rank0", [(2, 1, False, False), (1, 2, False, False), (1, 2, False, True),
                                                    (1, 1, True, False)],
                         ids=["tp2", "pp2", "pp2-log_rank0", "dp2-zero1"])
def test_lightning_parity(ranks2, tmp_path, tp, pp, zero1, log_rank0):
    ranks2.run(lightning_cases.check_parity, str(tmp_path), tp, pp, zero1, log_rank0)


def test_lightning_bf16_autocast(ranks2, tmp_path):
    ranks2.run(lightning_cases.check_bf16_autocast, str(tmp_path))


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2-zero1", "tp2"])
def test_lightning_gradient_accumulation(ranks2, tmp_path, tp):
    ranks2.run(lightning_cases.check_accumulation, str(tmp_path), tp)


def test_lightning_checkpoint_resumes_resharded(ranks2, tmp_path):
    ranks2.run(lightning_cases.check_resume_resharded, str(tmp_path))


def test_lightning_example_under_torchrun(no_rank_pool, tmp_path):
    """examples/lightning_causal_lm.py (capped): 12 steps at tp=2, then resumed from its checkpoint
    at dp=2 with ZeRO-1 for 8 more (--max-steps counts this run's steps); the loss falls, one rank
    prints and logs, and the resumed run says where it starts."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(*args):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "examples/lightning_causal_lm.py", "--output-dir", str(tmp_path), *args]
        result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if "loss fell from" in line]
        assert len(lines) == 1, result.stdout[-3000:]  # one rank reports
        first, last = map(float, lines[0].split("loss fell from ")[1].split(" to "))
        return first, last, result.stdout

    first, last, _ = run("--tp", "2", "--max-steps", "12")
    assert last < first - 0.5
    checkpoint = str(tmp_path / "last.ckpt")
    resumed_first, resumed_last, printed = run("--zero1", "--max-steps", "8", "--resume", checkpoint)
    assert resumed_first < first - 0.5 and resumed_last <= resumed_first + 0.1  # went on from the checkpoint
    said = [line for line in printed.splitlines() if line.startswith("resuming from")]
    assert said == [f"resuming from {checkpoint} (step 12, epoch 1): training to step 20"], printed[-3000:]
    runs = {}  # version directory -> the processes that wrote event files there (fit, then validate)
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        runs.setdefault(events.parent.name, set()).add(events.name.split(".")[-2])
    assert sorted(runs) == ["version_0", "version_1"] and all(len(pids) == 1 for pids in runs.values()), runs


def test_lightning_callbacks_and_reduce(ranks2, tmp_path):
    ranks2.run(lightning_cases.check_callbacks_and_reduce, str(tmp_path))
