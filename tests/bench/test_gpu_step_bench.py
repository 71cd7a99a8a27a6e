"""bench/gpu_step refuses to run without a GPU, with a message saying so, and
its case list holds every comparison the GPU step benchmark reports (HF loop and
Trainer, nxd_hf loop and trainer, with compile, Liger, LoRA, the fused loss)."""

import os
import subprocess
import sys

from bench.gpu_step.cases import all_cases, cases_for
from support.paths import REPO


def test_refuses_without_a_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env.pop("NXD_HF_BENCH_ALLOW_CPU", None)
    out = subprocess.run([sys.executable, "-m", "bench.gpu_step", "--shape", "1b"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "needs a CUDA GPU" in out.stderr, out.stderr


def test_cases_cover_every_reported_comparison():
    names = {c.name for c in all_cases()}
    for name in ("hf_loop", "hf_loop+compile", "hf_loop+liger", "hf_loop+liger+compile", "hf_trainer",
                 "hf_loop+lora_fp32", "hf_loop+lora_bf16", "nxd_loop", "nxd_loop+fused_loss+compile", "nxd_trainer",
                 "nxd_trainer+fused_loss", "nxd_loop+lora_bf16", "nxd_loop+lora_fp32+fused_loss"):
        assert name in names, name
    assert len(names) == len(all_cases())
    assert all(c.lora for c in cases_for("lora"))
