"""ZeRO-2/3 on FSDP2 (``parallelize(data_parallel_sharding=...)``) beside nxd_hf's ZeRO-1 and
beside torch's FSDP2 applied by hand to the plain HF model (the peer), on one set of gloo ranks
(CPU): parameter, gradient and AdamW-moment bytes per rank against the formula ``total / dp``
(FSDP2 pads dim 0 to a multiple of dp, so each tensor keeps ``ceil(rows / dp)`` rows), and the
median step time (forward, backward, clipping at 1.0, AdamW step; the slowest rank per step).
The methods run one after another in the same processes, so they see the same machine load
only roughly: compare times on a quiet machine.

Run from the repo root: ``python -m bench.fsdp [--steps N] [--dp 2]``.
"""

import argparse
import json

from bench.common import RESULTS
from bench.fsdp.rank import METHODS, measure
from nxd_hf.testing import run_distributed

MODEL = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=4000, max_position_embeddings=256, tie_word_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    config = {"model": MODEL, "batch": 2, "seq": 128, "steps": args.steps}
    per_rank = run_distributed(measure, args.dp, config, timeout_s=1200)
    total = per_rank[0]["num_params"]
    print(f"Llama {total / 1e6:.2f}M parameters, dp={args.dp}, fp32; bytes on rank 0 (formula: 4 x total / dp = "
          f"{4 * total / args.dp / 1e6:.3f} MB)")
    print(f"{'method':<16}{'params MB':>11}{'x formula':>11}{'grads MB':>10}{'AdamW MB':>10}{'step s':>9}")
    for method in METHODS:
        r = per_rank[0][method]
        print(f"{method:<16}{r['param_bytes'] / 1e6:>11.3f}{r['param_bytes'] / (4 * total / args.dp):>11.3f}"
              f"{r['grad_bytes'] / 1e6:>10.3f}{r['optimizer_bytes'] / 1e6:>10.3f}{r['step_seconds']:>9.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fsdp.json").write_text(json.dumps({"config": config, "per_rank": per_rank}, indent=1))
