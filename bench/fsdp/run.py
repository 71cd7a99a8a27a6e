"""ZeRO-2/3 on FSDP2 (``parallelize(data_parallel_sharding=...)``) beside nxd_hf's ZeRO-1 and
beside torch's FSDP2 applied by hand to the plain HF model (the peer), on one set of gloo ranks
(CPU): parameter, gradient and AdamW-moment bytes per rank against the formula ``total / dp``
(FSDP2 pads dim 0 to a multiple of dp, so each tensor keeps ``ceil(rows / dp)`` rows), and the
median step time (forward, backward, clipping at 1.0, AdamW step; the slowest rank per step),
and each rank's peak RssAnon over its baseline while training (``bench/fsdp/rank.py``) against
the floor: the parameter, gradient and AdamW bytes it holds.
The methods run one after another in the same processes, so they see the same machine load
only roughly: compare times on a quiet machine.

Run from the repo root: ``python -m bench.fsdp [--steps N] [--dp 2]``.
"""

import argparse
import json
import os

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.fsdp.rank import METHODS, measure

MODEL = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=4000, max_position_embeddings=256, tie_word_embeddings=False)


def format_table(result: dict) -> str:
    """The markdown table of a result (``docs/benchmarks.md``): rank 0's bytes, the largest peak of any rank."""
    per_rank, dp = result["per_rank"], len(result["per_rank"])
    total = per_rank[0]["num_params"]
    lines = [f"Llama {total / 1e6:.2f}M parameters, dp={dp}, fp32, batch {result['config']['batch']} x seq "
             f"{result['config']['seq']} per rank; formula = 4 B x parameters / dp = {4 * total / dp / 1e6:.2f} MB. "
             "Floor = params + grads + AdamW MB held by the rank; peak = the largest RssAnon over its baseline "
             "of any rank while training (activations, gathered layers and buffers on top of the floor).",
             "| method | params MB | params / formula | grads MB | AdamW MB | floor MB | peak MB | peak / floor | "
             "step s |", "|---|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        r = per_rank[0][method]
        floor = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        peak = max(rank[method]["peak_over_baseline_bytes"] for rank in per_rank)
        lines.append(f"| {method} | {r['param_bytes'] / 1e6:.2f} | {r['param_bytes'] / (4 * total / dp):.3f} | "
                     f"{r['grad_bytes'] / 1e6:.2f} | {r['optimizer_bytes'] / 1e6:.2f} | {floor / 1e6:.2f} | "
                     f"{peak / 1e6:.2f} | {peak / floor:.2f} | {r['step_seconds']:.3f} |")
    if result.get("note"):
        lines.append(result["note"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--note", default="", help="a line under the table (say if the machine was shared)")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # every tensor its own mapping, returned when freed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from nxd_hf.testing import run_distributed

    config = {"model": MODEL, "batch": 2, "seq": 128, "steps": args.steps}
    per_rank = run_distributed(measure, args.dp, config, timeout_s=1200)
    result = {**stamp(), "config": config, "note": args.note, "per_rank": per_rank}
    print(format_table(result))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fsdp.json").write_text(json.dumps(result, indent=1))

