"""Peak CPU memory and time of one forward + backward of the causal-LM loss from the hidden
states, the LM head included, at a large vocabulary (default vocab 128,256 as Llama 3, hidden
128, batch 1 x seq 4096: four chunks, fp32), two ways, each in its own process:

- ``unfused``: ``F.linear`` to the full logits, then ``F.cross_entropy`` (what plain HF and
  nxd_hf at tp=1 do without ``fused_loss``);
- ``fused``: ``nxd_hf.parallel_layers.fused_loss.fused_linear_cross_entropy`` (tp=1, a one-rank
  gloo group), which never holds the full logits.

Peak: the rise of the process's peak RSS (``ru_maxrss``) over the reading taken once the
inputs exist (no warm-up step: the first step's peak is the one measured); time: median of
``--steps`` steps (the first included: on a shared CPU a step takes seconds, a warm-up adds little). The logits alone
are seq x vocab x 4 B (2.1 GB at the defaults). JSON in ``bench/results/fused_loss.json``
(``--dtype bfloat16``: ``fused_loss_bfloat16.json``; the unfused way upcasts the bf16 logits as HF does;
the fp32 logits are counted).

Time is also measured with both ways in turn in one process (``--rounds`` steps each, wall and
CPU seconds): the ratio of that run is the one to read on a shared machine.

Run from the repo root: ``python -m bench.fused_loss [--vocab 128256] [--hidden 512] [--seq 1024] [--rounds 3]``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench.common import RESULTS
from bench.common.stamp import stamp


def _case(mode: str, vocab: int, hidden: int, seq: int, steps: int, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F

    from nxd_hf import parallel_state
    from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel_state.initialize_model_parallel(1, 1)
    g = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(1, seq, hidden, generator=g).to(getattr(torch, dtype)).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(getattr(torch, dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (1, seq), generator=g)

    def step(mode=mode):
        if mode == "fused":
            loss = fused_linear_cross_entropy(hidden_states, weight, labels, vocab_size=vocab)
        else:
            logits = F.linear(hidden_states, weight)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        hidden_states.grad = weight.grad = None
        return loss.item()

    if mode == "interleaved":  # time only: both ways in turn, in one process, so both see the same machine
        wall, cpu = {"unfused": [], "fused": []}, {"unfused": [], "fused": []}
        for _ in range(steps):
            for way in ("unfused", "fused"):
                start, start_cpu = time.perf_counter(), time.process_time()
                step(way)
                wall[way].append(time.perf_counter() - start)
                cpu[way].append(time.process_time() - start_cpu)
        return {"mode": mode, "rounds": steps, **{f"{kind}_s_{way}": sorted(values[way]) for kind, values in
                                                  (("wall", wall), ("cpu", cpu)) for way in values},
                "wall_ratio_fused_over_unfused": statistics.median(wall["fused"]) / statistics.median(wall["unfused"]),
                "cpu_ratio_fused_over_unfused": statistics.median(cpu["fused"]) / statistics.median(cpu["unfused"])}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # inputs made; the first step's peak counts
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "loss": loss, "peak_rise_mib": (after - before) / 1024,
            "step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of the hidden states and the head (bfloat16: as a bf16 model trains)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (one step each way)")
    parser.add_argument("--case", choices=["fused", "unfused", "interleaved"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case, args.vocab, args.hidden, args.seq, args.steps, args.dtype)))
        return
    cases = {}
    for mode in ("unfused", "fused", "interleaved"):
        steps = args.rounds if mode == "interleaved" else args.steps
        out = subprocess.run([sys.executable, "-m", "bench.fused_loss", "--case", mode, "--vocab", str(args.vocab),
                              "--hidden", str(args.hidden), "--seq", str(args.seq), "--steps", str(steps), "--dtype", args.dtype],
                             check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        cases[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(mode, cases[mode], flush=True)
    result = {**stamp(), "vocab": args.vocab, "hidden": args.hidden, "seq": args.seq, "batch": 1, "dtype": args.dtype,
              "logits_mib": args.seq * args.vocab * 4 / 2**20, "cases": cases,
              "peak_ratio_fused_over_unfused": cases["fused"]["peak_rise_mib"] / cases["unfused"]["peak_rise_mib"],
              "time_ratio_fused_over_unfused": cases["fused"]["step_s_median"] / cases["unfused"]["step_s_median"],
              "interleaved_wall_ratio": cases["interleaved"]["wall_ratio_fused_over_unfused"],
              "interleaved_cpu_ratio": cases["interleaved"]["cpu_ratio_fused_over_unfused"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("fused_loss.json" if args.dtype == "float32" else f"fused_loss_{args.dtype}.json")).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
