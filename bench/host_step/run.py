"""The host's share of a training step at tp=1: plain HF against ``nxd_hf.parallelize(tp=1)``, the
same loop (forward, backward, clipping at 1.0 as ``Trainer`` does, AdamW), one process.

On a GPU the host launches the kernels; what nxd_hf adds there is Python work per step. On a CPU
that work can be measured apart from the kernels with a model so small that the kernels cost
next to nothing (hidden 64, 2 layers, 2 x 32 tokens, fp32, one thread):

- the Python function calls per step (``cProfile``, deterministic: the same count on any load),
  with the functions nxd_hf calls that plain HF does not, most called first;
- nxd_hf also without the heap trims it does only where the model computes on the CPU
  (``GradReduction.release_host_memory``): the host work a GPU step has;
- the CPU seconds per step, the models in turn in one process (``time.process_time``; median
  and spread over ``--rounds``), so both see the same machine.

Writes ``bench/results/host_step.json``. Run from the repo root: ``python -m bench.host_step [--rounds 200]``.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch

from bench.common import RESULTS
from bench.common.stamp import stamp

MAX_GRAD_NORM = 1.0


def _models():
    import transformers

    import nxd_hf
    from nxd_hf import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29581"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel_state.initialize_model_parallel(1, 1)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    ours = nxd_hf.parallelize(transformers.LlamaForCausalLM(config), tensor_parallel_size=1)
    torch.manual_seed(0)
    # what runs on a GPU: the heap trims around forward and backward are the CPU's only
    like_gpu = nxd_hf.parallelize(transformers.LlamaForCausalLM(config), tensor_parallel_size=1)
    like_gpu.nxd.grad_reduction.release_host_memory = False
    clip = nxd_hf.parallel_layers.clip_grad_norm
    return {"plain_hf": (plain, torch.nn.utils.clip_grad_norm_), "nxd_hf_tp1": (ours, clip),
            "nxd_hf_tp1_no_trim": (like_gpu, clip)}


def _stepper(model, clip):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _calls(step) -> tuple[int, dict]:
    """Python function calls of one step, and the calls per function."""
    profile = cProfile.Profile()
    profile.runcall(step)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, total calls, ...)}
    per_function = {f"{os.path.basename(k[0])}:{k[2]}": v[1] for k, v in stats.items()}
    return sum(v[1] for v in stats.values()), per_function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = {name: _stepper(model, clip) for name, (model, clip) in _models().items()}
    for step in steps.values():  # warm-up: lazy inits, optimizer state
        step(), step()
    calls = {name: _calls(step) for name, step in steps.items()}
    cpu = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.process_time()
            step()
            cpu[name].append(time.process_time() - start)
    plain_functions, our_functions = calls["plain_hf"][1], calls["nxd_hf_tp1"][1]
    extra = sorted(((n - plain_functions.get(f, 0), f) for f, n in our_functions.items()
                    if n > plain_functions.get(f, 0)), reverse=True)[:15]
    result = {**stamp(), "model": "llama hidden 64, 2 layers, batch 2 x 32, fp32, 1 thread", "rounds": args.rounds,
              "calls_per_step": {name: c[0] for name, c in calls.items()},
              "calls_ratio": calls["nxd_hf_tp1"][0] / calls["plain_hf"][0],
              "extra_calls_by_function": {f: n for n, f in extra},
              "cpu_ms_median": {n: 1e3 * statistics.median(v) for n, v in cpu.items()},
              "cpu_ms_p10_p90": {n: [1e3 * sorted(v)[len(v) // 10], 1e3 * sorted(v)[9 * len(v) // 10]]
                                 for n, v in cpu.items()},
              "cpu_ratio": statistics.median(cpu["nxd_hf_tp1"]) / statistics.median(cpu["plain_hf"]),
              "cpu_ratio_no_trim": statistics.median(cpu["nxd_hf_tp1_no_trim"]) / statistics.median(cpu["plain_hf"])}
    print(f"{'case':12s} {'calls/step':>10s} {'CPU ms (median)':>16s} {'p10-p90':>14s}")
    for name in steps:
        p10, p90 = result["cpu_ms_p10_p90"][name]
        print(f"{name:12s} {result['calls_per_step'][name]:10d} {result['cpu_ms_median'][name]:16.2f} "
              f"{p10:6.2f}-{p90:6.2f}")
    print(f"nxd_hf / plain: calls {result['calls_ratio']:.3f}, CPU time {result['cpu_ratio']:.3f} "
          f"({result['cpu_ratio_no_trim']:.3f} without the CPU-only heap trims)")
    print("most extra calls:", ", ".join(f"{f} +{n}" for f, n in list(result["extra_calls_by_function"].items())[:8]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "host_step.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
