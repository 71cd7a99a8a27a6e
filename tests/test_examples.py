"""End-to-end: the README's main job under torchrun."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script: str, nproc: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), script, *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_parallelize_causal_lm_loss_falls():
    out = run_example("examples/parallelize_causal_lm.py", 2, "--steps", "25")
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", out).groups())
    assert last < first - 1.0, out


def test_train_with_config_api_pp2_zero1_loss_falls(tmp_path):
    """Then a second job resumes from the asynchronous checkpoint the first saved at exit, at
    other parallel sizes (tp 2 x dp 2), and keeps training."""
    ckpt = str(tmp_path / "ckpt")
    out = run_example("examples/train_with_config_api.py", 4, "--pp", "2", "--zero1", "--steps", "12",
                      "--checkpoint-dir", ckpt, "--save-every", "6")
    assert "tp 1 x pp 2 x dp 2, zero1=True" in out, out
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", out).groups())
    assert last < first - 1.0, out
    assert sorted(os.listdir(ckpt)) == ["checkpoints.json", "step12", "step6"]
    resumed = run_example("examples/train_with_config_api.py", 4, "--tp", "2", "--zero1", "--steps", "16",
                          "--checkpoint-dir", ckpt, "--save-every", "6")
    assert "resumed from step 12" in resumed, resumed
    after = float(re.search(r"step  12  loss ([\d.]+)", resumed).group(1))  # no restart from scratch
    assert after < first - 1.0, resumed
