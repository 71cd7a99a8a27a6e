"""Communication volume of one transformer block's forward + backward under tensor parallelism
beside the itemized theory (the measurement and theory: ``bench.comm_volume.measure``).

Run from the repo root: ``python -m bench.comm_volume [--out PATH] [--batch B] [--seq S]``.
"""

import argparse
import dataclasses
import json
import os

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.comm_volume.measure import run
from bench.comm_volume.tp_block import BlockConfig


def format_case(case: dict) -> str:
    header = (f"tp={case['tp']} sequence_parallel={case['sequence_parallel']} "
              f"kv_size_multiplier={case['kv_size_multiplier']}")
    cols = f"{'phase':<13} {'op':<15} {'kind':<11} {'n':>3} {'counted B':>11} {'theory B':>11} {'ratio':>6} " \
           f"{'ring B/rank':>12}  theory formula"
    lines = [header, cols, "-" * len(cols)]
    for row in case["terms"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"{row['phase']:<13} {row['op']:<15} {row['kind']:<11} {row['count']:>3} {row['bytes']:>11,} "
                     f"{row['theory_bytes']:>11,} {ratio:>6} {row['ring_bytes_per_rank']:>12,.0f}  {row['formula']}")
    t = case["total"]
    ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
    lines.append(f"{'total':<41} {t['count']:>3} {t['bytes']:>11,} {t['theory_bytes']:>11,} "
                 f"{ratio:>6} {t['ring_bytes_per_rank']:>12,.0f}")
    extras = ", ".join(f"{e['phase']} {e['op']} {e['bytes']:,} B ({e['share_of_total']:.1%})"
                       for e in case["extra_terms"])
    lines.append(f"extra terms: {extras or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.comm_volume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "comm_volume.json"))
    parser.add_argument("--batch", type=int, default=BlockConfig.batch)
    parser.add_argument("--seq", type=int, default=BlockConfig.seq)
    args = parser.parse_args(argv)
    config = BlockConfig(batch=args.batch, seq=args.seq)
    results = run(config)
    print(f"config: {dataclasses.asdict(config)} head_dim={config.head_dim} fp32; payload = bytes each rank "
          "hands to a collective; all cases match the unsharded reference (output, input grad, every param grad)\n")
    print("\n\n".join(format_case(case) for case in results))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(**stamp(), config=dataclasses.asdict(config), head_dim=config.head_dim, dtype="float32",
                       payload_definition="bytes of the tensor each rank hands to the collective",
                       cases=results), f, indent=1)
    print(f"\nwrote {args.out}")
