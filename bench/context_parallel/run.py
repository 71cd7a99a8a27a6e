"""The longest sequence one training step takes within a per-rank memory budget, at cp = 1, 2, ...

For each context-parallel size, fresh ``torch.distributed.run`` worlds of cp ranks (gloo, CPU)
run one forward and backward of a small Llama (``CONFIG``, fp32, ring attention at cp > 1, HF's
SDPA at cp = 1, both through ``nxd_hf.parallelize``) on one sequence of S tokens; each rank
samples its ``RssAnon`` in a thread (``bench.memory.rank.PeakSampler``) and reports the peak
above the reading taken just before the step (model built, inputs made). S doubles from
``--start`` until a step exceeds the budget on some rank, then a bisection to ``--step`` tokens
finds the longest S within it. Target: the longest S at cp = 2 >= 1.8 x the longest at cp = 1.

Run from the repo root: ``python -m bench.context_parallel [--budget-mib 256] [--cp 1 2 4] [--out PATH]``
(docs/benchmarks.md: ``--budget-mib 64 --cp 1 2 4 --start 1024 --step 256``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.common import REPO, RESULTS
from bench.common.rank_results import rank_results
from bench.common.stamp import stamp

CONFIG = dict(hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=512, max_position_embeddings=1 << 20, tie_word_embeddings=False)


def worker(cp: int, seq_len: int, result_dir: str) -> None:
    import torch
    import transformers

    import nxd_hf
    from bench.memory.rank import PeakSampler, read_status
    from nxd_hf import backend

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    model = nxd_hf.parallelize(model, context_parallel_size=cp, check_inputs=False)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    backend.barrier()
    base = read_status()["RssAnon"]
    with PeakSampler(0.002) as sampler:
        model(input_ids=ids, labels=ids).loss.backward()
    peak = sampler.peak["RssAnon"]
    with open(os.path.join(result_dir, f"rank{backend.rank()}.json"), "w") as f:
        json.dump({"peak_above_base": peak - base, "samples": sampler.samples}, f)


def probe(cp: int, seq_len: int, timeout_s: float) -> int | None:
    """The largest per-rank peak above the baseline of one step, in bytes (None: the step failed)."""
    with tempfile.TemporaryDirectory() as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
               "-m", "bench.context_parallel", "--worker", "--cp", str(cp), "--seq", str(seq_len),
               "--result-dir", result_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRANSFORMERS_VERBOSITY="error")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        except subprocess.TimeoutExpired:
            return None
        ranks = rank_results(result_dir, cp)
    if proc.returncode != 0 or len(ranks) < cp:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return max(r["peak_above_base"] for r in ranks)


def longest(cp: int, budget: int, start: int, step: int, timeout_s: float) -> tuple[int, list]:
    """The longest S (a multiple of ``step``) whose step stays within ``budget``; the probes made."""
    probes = []

    def fits(seq_len: int) -> bool:
        peak = probe(cp, seq_len, timeout_s)
        probes.append((seq_len, peak))
        print(f"  cp={cp} S={seq_len}: {'failed' if peak is None else f'{peak / 2**20:.0f} MiB'}", flush=True)
        return peak is not None and peak <= budget

    good, bad = 0, start
    while fits(bad):
        good, bad = bad, bad * 2
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, probes


def format_table(result: dict) -> str:
    """The markdown table of a result (``docs/benchmarks.md``, ``docs/context_parallel.md``)."""
    budget = result["budget_mib"]
    lines = [f"| cp | attention | longest sequence within {budget:.0f} MiB per rank | vs cp=1 | "
             "peak per rank at that length |", "|---|---|---|---|---|"]
    for cp, row in result["cp"].items():
        peak = next((p["peak_mib"] for p in row["probes"] if p["seq"] == row["longest_seq"]), None)
        lines.append(f"| {cp} | {'HF SDPA' if cp == '1' else 'ring'} | {row['longest_seq']} | "
                     f"{row['vs_first']:.2f}x | {'-' if peak is None else f'{peak:.0f} MiB'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq", type=int)
    parser.add_argument("--result-dir")
    parser.add_argument("--budget-mib", type=float, default=256)
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--step", type=int, default=512)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", default=str(RESULTS / "context_parallel.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.cp[0], args.seq, args.result_dir)
    budget = int(args.budget_mib * 2**20)
    rows = {}
    for cp in args.cp:
        best, probes = longest(cp, budget, args.start, args.step, args.timeout_s)
        rows[cp] = {"longest_seq": best, "probes": [{"seq": s, "peak_mib": None if p is None else p / 2**20}
                                                    for s, p in probes]}
        print(f"cp={cp}: longest sequence within {args.budget_mib:.0f} MiB per rank: {best} tokens", flush=True)
    base = rows[args.cp[0]]["longest_seq"]
    for cp in args.cp:
        rows[cp]["vs_first"] = rows[cp]["longest_seq"] / base if base else None
        print(f"cp={cp}: {rows[cp]['vs_first']:.2f}x the longest at cp={args.cp[0]}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**stamp(), "budget_mib": args.budget_mib, "config": CONFIG, "cp": rows}, f, indent=1)
