"""bench/gpu_step refuses to run without a GPU, with a message saying so, and
its case list holds every comparison the GPU step benchmark reports (HF loop and
Trainer, nxd_hf loop and trainer, with compile, Liger, LoRA, the fused loss)."""

import json
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


def _report(shape: str, tokens: dict, peaks: dict) -> dict:
    cases = [{"case": name, "tokens_per_s": t, "spread": 0.02, "mfu": None if "lora" in name else 0.4,
              "peak_gib": peaks.get(name, 30.0)} for name, t in tokens.items()]
    cases.append({"case": "hf_loop+liger+compile", "skipped": "No module named 'liger_kernel'"})
    return {"date": "2026-12-02", "gpu": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.24.0",
            "peft": "0.21.2", "liger_kernel": None, "shape": shape, "batch": 4, "seq": 2048, "warmup": 3,
            "steps": 10, "cases": cases}


def test_peers_of_every_case():
    from bench.gpu_step.report import peer_of

    assert peer_of("nxd_loop") == "hf_loop" and peer_of("nxd_trainer+compile") == "hf_trainer+compile"
    assert peer_of("nxd_loop+lora_bf16+fused_loss") == "hf_loop+lora_bf16"
    assert peer_of("nxd_loop+liger+fused_loss+compile") == "hf_loop+liger+compile"
    assert peer_of("hf_loop+liger") == "hf_loop" and peer_of("hf_loop") is None and peer_of("hf_loop+lora_fp32") is None
    names = {c.name for c in all_cases()}  # every nxd_hf loop case has its peer among the cases
    assert all(peer_of(n) in names for n in names if n.startswith("nxd_loop"))


def test_table_and_targets_from_a_report(tmp_path):
    from bench.docs_tables import render_gpu_speed
    from bench.gpu_step.report import format_table

    report = _report("1b", {"hf_loop": 46000, "nxd_loop": 46920, "nxd_loop+fused_loss": 45000, "hf_loop+liger": 56000,
                            "nxd_loop+liger+fused_loss": 58000, "hf_trainer": 39000, "nxd_trainer": 38000},
                     {"nxd_loop": 32.0, "nxd_loop+fused_loss": 20.0})
    text = format_table(report)
    assert "| nxd_loop | 46,920 | 1.020x hf_loop | 40.0% | 32.0 | 2.0% |" in text
    assert "| hf_loop+liger+compile | skipped: No module named 'liger_kernel' | | | | |" in text
    assert "nxd_loop / hf_loop = 1.020 (bar 1.0): met" in text
    assert "nxd_trainer / hf_trainer = 0.974 (bar 1.0): MISSED" in text
    assert "nxd_loop+fused_loss / nxd_loop = 0.959 (bar 1.0): MISSED" in text
    assert "peak nxd_loop+fused_loss / nxd_loop = 0.625 (bar 0.7): met" in text
    assert "(nxd_loop+liger+fused_loss) against one line of Liger: nxd_loop+liger+fused_loss / hf_loop+liger = 1.036" in text
    assert "/ hf_loop = 1.261 (bar 1.25): met" in text
    (tmp_path / "gpu_step_1b.json").write_text(json.dumps(report))
    page = "a\n<!-- bench:gpu_step_1b:begin -->\nold\n<!-- bench:gpu_step_1b:end -->\nb\n" \
           "<!-- bench:gpu_step_8b:begin -->\n<!-- bench:gpu_step_8b:end -->\n"
    rendered = render_gpu_speed(page, tmp_path)
    assert "*Measured 2026-12-02 on NVIDIA H200 (torch 2.11.0, transformers 5.24.0, peft 0.21.2)" in rendered
    assert "old" not in rendered and text in rendered
    assert "*Not measured yet: `python -m bench.gpu_step --shape 8b`" in rendered


def test_8b_lora_target():
    from bench.gpu_step.report import targets

    report = _report("8b", {"hf_loop+lora_bf16": 12040, "nxd_loop+lora_bf16": 12600}, {})
    assert "- 8B LoRA, bf16 adapters: 12,600 tokens/s (bar 12,500): met" in targets(report)
