"""Training step throughput on one GPU in one run per shape: plain HF
(bare loop; + ``torch.compile``; + Liger's ``apply_liger_kernel_to_llama`` with and without
compile), ``transformers.Trainer``, peft LoRA r=16 all-linear (fp32 and bf16 adapters),
``nxd_hf.parallelize(tp=1)`` in the same loop, ``NxDTrainer``, nxd_hf LoRA (both adapter dtypes),
the nxd_hf ones with and without ``fused_loss`` and compile (``bench/gpu_step/cases.py``).

Random weights, bf16 weights and AdamW (``Trainer`` cases: fp32 weights with ``bf16=True``), a
Llama shape (``--shape 1b``: Llama-3.2-1B, batch 4; ``8b``: Llama-3.1-8B, LoRA cases, batch 2;
seq 2048). Each case in its own process; ``--warmup`` steps dropped, then the median of
``--steps`` synchronized step times: tokens/s, the spread ((max - min) / median), MFU of
(6N + 12 L h s) FLOPs per token against 989 TFLOP/s (H100 dense bf16; not for LoRA) and the
peak of ``torch.cuda.max_memory_allocated``. Liger cases need ``pip install liger-kernel``
(imported only by them; reported as skipped without it). JSON: ``bench/results/gpu_step_<shape>.json``;
the table (``bench/gpu_step/report.py``: each nxd_hf case against its plain peer, and the targets)
is printed and, for a whole shape (no ``--only``), written into ``docs/gpu_speed.md`` with the
date, GPU and versions.

Refuses to run without a GPU. Run from the repo root: ``python -m bench.gpu_step --shape 1b``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.gpu_step.cases import SHAPES, all_cases, cases_for
from bench.gpu_step.report import format_table, heading

NO_GPU = ("bench.gpu_step measures GPU training throughput and needs a CUDA GPU; torch.cuda.is_available() is "
          "False here. Run it on a machine with an NVIDIA GPU (docs/gpu_speed.md)")


def _versions() -> dict:
    import peft
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU smoke run)"
    try:
        from importlib.metadata import version

        liger = version("liger-kernel")
    except Exception:  # not installed: its cases report as skipped
        liger = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "liger_kernel": liger, "gpu": gpu}


def _run_one(name: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu_step", "--shape", args.shape, "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--case", name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        skipped = ("liger_kernel" in out.stderr and "No module named" in out.stderr
                   or "Triton kernels for CUDA GPUs" in out.stderr)  # the CPU smoke shape
        return {"case": name, "skipped" if skipped else "error": " | ".join(tail)}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--case-timeout", type=int, default=1800)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    smoke = os.environ.get("NXD_HF_BENCH_ALLOW_CPU") == "1" and args.shape == "tiny"
    if not torch.cuda.is_available() and not smoke:
        sys.exit(f"error: {NO_GPU}")
    if args.case:
        from bench.gpu_step.case import run_case

        case = {c.name: c for c in all_cases()}[args.case]
        with tempfile.TemporaryDirectory() as out_dir:
            print(json.dumps(run_case(case, args.shape, args.warmup, args.steps, out_dir)), flush=True)
        return
    results = []
    for case in cases_for(SHAPES[args.shape][3]):
        if args.only in case.name:
            results.append(_run_one(case.name, args))
            print(json.dumps(results[-1]), flush=True)
    kwargs, batch, seq, _ = SHAPES[args.shape]
    report = {**stamp(), **_versions(), "shape": args.shape, "config": kwargs, "batch": batch, "seq": seq,
              "warmup": args.warmup, "steps": args.steps, "cases": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "gpu_step_smoke.json" if smoke else f"gpu_step_{args.shape}.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2) + "\n")
    print(heading(report), format_table(report), sep="\n\n")
    if not smoke and not args.only:  # the whole shape: its table in docs/gpu_speed.md
        from bench.docs_tables import GPU_SPEED, render_gpu_speed

        GPU_SPEED.write_text(render_gpu_speed(GPU_SPEED.read_text()))


if __name__ == "__main__":
    main()
