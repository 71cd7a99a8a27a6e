"""Expert parallelism's costs beside their theory, in one run:

- all-to-all bytes of one training step (forward + backward), itemized: token rows dispatched
  and combined, forward and backward, against the minimum ``tokens x top-k x hidden x bytes`` each
  (every (token, expert) assignment crosses once per direction; summed over the ranks), plus the
  overheads: routing weights (``tokens x top-k x 4`` each way) and the split-size exchange
  (``experts x 8`` per layer); also how many bytes really leave a rank (rows routed to another
  rank's experts);
- parameter and AdamW-state bytes per rank against ``total experts / (tp x ep) + replicated``
  (tp = 1 here; the optimizer's expectation is twice that, plus its step scalars).

Run from the repo root: ``python -m bench.moe [--out PATH]``; writes ``bench/results/moe.json``.
"""

import argparse
import dataclasses
import json
import os

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.common.table import Column, table
from bench.moe.measure import MoEConfig, measure_rank
from nxd_hf.testing import run_distributed

CASES = [(2, 2), (4, 2), (4, 4)]  # (world = dp, ep)


def _case(config: MoEConfig, world: int, ep: int, ranks: list[dict]) -> dict:
    element = 4  # fp32
    assignments = sum(r["assignments"] for r in ranks)
    minimum = assignments * config.hidden * element  # per direction, all ranks, all layers
    tags = ranks[0]["bytes_by_tag"].keys()
    measured = {tag: sum(r["bytes_by_tag"][tag] for r in ranks) for tag in tags}
    token_items = ("ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward")
    terms = [dict(item=tag, bytes=measured[tag], minimum=minimum, ratio=measured[tag] / minimum) for tag in token_items]
    overhead = {tag: measured[tag] for tag in tags if tag not in token_items}
    total = sum(measured.values())
    leaving = sum(r["assignments_leaving"] for r in ranks) * config.hidden * element
    memory = []
    for r in ranks:
        expected = r["expert_total_bytes"] / ep + r["replicated_bytes"]  # tp = 1
        memory.append(dict(rank=r["rank"], param_bytes=r["param_bytes"], expected_param_bytes=expected,
                           param_ratio=r["param_bytes"] / expected, optimizer_bytes=r["optimizer_bytes"],
                           expected_optimizer_bytes=2 * expected + r["optimizer_scalar_bytes"],
                           optimizer_ratio=r["optimizer_bytes"] / (2 * expected + r["optimizer_scalar_bytes"]),
                           unsharded_param_bytes=r["expert_total_bytes"] + r["replicated_bytes"]))
    return dict(world=world, dp=world, ep=ep, tp=1, tokens_per_rank=ranks[0]["tokens"], assignments=assignments,
                token_terms=terms, overhead_bytes=overhead, total_bytes=total, total_minimum=4 * minimum,
                total_ratio=total / (4 * minimum), bytes_leaving_ranks_per_direction=leaving,
                leaving_share=leaving / minimum, expected_leaving_share_uniform=(ep - 1) / ep, memory=memory)


_ITEMS = [Column(title="all-to-all item", width=22, left=True), Column(title="bytes", width=10, spec=","),
          Column(title="minimum", width=10, spec=","), Column(title="ratio", width=6, spec=".3f")]
_MEMORY = [Column(title="rank", width=5, left=True), Column(title="params B", width=10, spec=","),
           Column(title="expected", width=10, spec=",.0f"), Column(title="ratio", width=6, spec=".3f"),
           Column(title="AdamW B", width=10, spec=","), Column(title="expected", width=10, spec=",.0f"),
           Column(title="ratio", width=6, spec=".3f"), Column(title="unsharded params B", width=19, spec=",")]


def format_case(case: dict) -> str:
    items = [(t["item"], t["bytes"], t["minimum"], t["ratio"]) for t in case["token_terms"]]
    items += [(tag, value, "(overhead)") for tag, value in case["overhead_bytes"].items()]
    items.append(("total", case["total_bytes"], case["total_minimum"], case["total_ratio"]))
    memory = [(m["rank"], m["param_bytes"], m["expected_param_bytes"], m["param_ratio"], m["optimizer_bytes"],
               m["expected_optimizer_bytes"], m["optimizer_ratio"], m["unsharded_param_bytes"]) for m in case["memory"]]
    return "\n".join([
        f"dp={case['dp']} ep={case['ep']} tp=1: {case['assignments']} assignments (tokens x top-k, all ranks)",
        *table(_ITEMS, items),
        f"rows leaving their rank: {case['leaving_share']:.1%} of the minimum per direction "
        f"(uniform routing: {case['expected_leaving_share_uniform']:.0%})",
        *table(_MEMORY, memory)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "moe.json"))
    args = parser.parse_args(argv)
    config = MoEConfig()
    cases = []
    for world, ep in CASES:
        ranks = run_distributed(measure_rank, world, config, ep, timeout_s=600)
        cases.append(_case(config, world, ep, ranks))
    print(f"config: {dataclasses.asdict(config)} fp32, one step (forward + backward); bytes = what each rank hands "
          "to the all-to-all, summed over ranks\n")
    print("\n\n".join(format_case(case) for case in cases))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(dict(**stamp(), config=dataclasses.asdict(config), dtype="float32", cases=cases), f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(f"\nwrote {args.out}")
