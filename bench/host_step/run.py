"""The host's share of a training step at tp=1: nxd_hf against its plain peer, in the cases of
``bench/gpu_step`` (the loop clipping at 1.0 as ``Trainer`` does, LoRA with fp32 and with bf16
adapters, ``Trainer``).

On a GPU the host launches the kernels; what nxd_hf adds there is Python work per step. On a CPU
that work can be measured apart from the kernels with a model whose kernels cost next to
nothing: the layers of the Llama-3.2-1B shape (16 decoder layers, 7 projections each, a tied
head) at hidden 16, one row of 4 tokens, one thread. Per case:

- the Python function calls per step (``cProfile``, deterministic: the same count on any load;
  a generator's resumptions count as calls), with the functions nxd_hf calls more than its peer;
- the CPU seconds per step, median and p10-p90 over ``--rounds``; the loop and LoRA pairs in
  turn in one process, so both see the same machine; ``Trainer`` and ``NxDTrainer`` each in their
  own process (a plain ``Trainer`` under torchrun's variables would wrap the model in DDP), in
  turn, twice.

nxd_hf runs as on a GPU: without the heap trims it does only where the model computes on the CPU
(``GradReduction.release_host_memory``). Writes ``bench/results/host_step.json``. Run from the
repo root: ``python -m bench.host_step [--rounds 200]``.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import RESULTS
from bench.common.stamp import stamp
from bench.common.table import Column, table

MAX_GRAD_NORM = 1.0
MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=16, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
TOKENS = 4
LOOP_CASES = {"loop": None, "lora_fp32": "fp32", "lora_bf16": "bf16"}  # case: adapter dtype


def _single_process() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("NXD_HF_BENCH_PORT", "29581"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def _like_gpu() -> None:
    """No heap trims in every policy built so far: a GPU's activations are not on the C heap."""
    from nxd_hf.parallel_layers import grad_reduction

    for policy in grad_reduction._LIVE:
        policy.release_host_memory = False


def _lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _loop_pair(adapters: str | None) -> dict:
    """{"plain": (model, clip), "nxd_hf": (model, clip)}: bf16 weights as ``bench/gpu_step``."""
    import peft
    import transformers

    import nxd_hf

    config = transformers.LlamaConfig(**MODEL)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if adapters:
        plain = peft.get_peft_model(plain, _lora_config(), autocast_adapter_dtype=adapters == "fp32")
    torch.manual_seed(0)
    ours = nxd_hf.parallelize(transformers.LlamaForCausalLM(config).to(torch.bfloat16), tensor_parallel_size=1,
                              lora_config=_lora_config() if adapters else None,
                              autocast_adapter_dtype=adapters == "fp32")
    _like_gpu()
    return {"plain": (plain, torch.nn.utils.clip_grad_norm_), "nxd_hf": (ours, nxd_hf.parallel_layers.clip_grad_norm)}


def _stepper(model, clip):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)  # as on a GPU (the CPU default loops)
    ids = torch.randint(0, MODEL["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(1))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _calls(run) -> tuple[int, dict]:
    """Python function calls of ``run()``, and the calls per function."""
    profile = cProfile.Profile()
    profile.runcall(run)
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, total calls, ...)}
    return sum(v[1] for v in stats.values()), {f"{os.path.basename(k[0])}:{k[2]}": v[1] for k, v in stats.items()}


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"cpu_ms_median": 1e3 * statistics.median(values),
            "cpu_ms_p10_p90": [1e3 * ordered[len(ordered) // 10], 1e3 * ordered[9 * len(ordered) // 10]]}


def _loop_case(adapters: str | None, rounds: int) -> dict:
    steps = {name: _stepper(*pair) for name, pair in _loop_pair(adapters).items()}
    for step in steps.values():  # warm-up: lazy inits, optimizer state
        step(), step()
    calls = {name: _calls(step) for name, step in steps.items()}
    cpu = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.process_time()
            step()
            cpu[name].append(time.process_time() - start)
    return {name: {"calls": calls[name][0], "calls_by_function": calls[name][1], **_spread(cpu[name])}
            for name in steps}


def _trainer_case(kind: str, steps: int) -> dict:
    """One ``Trainer`` (kind "plain") or ``NxDTrainer`` run of ``steps`` steps in this process:
    fp32 weights under bf16 autocast, as ``bench/gpu_step``'s."""
    import transformers

    import nxd_hf

    times, calls = [], {}

    class Timer(transformers.TrainerCallback):
        """CPU time of every step; the Python calls of the fifth (``cProfile`` on for that step only)."""

        def on_step_begin(self, *args, **kwargs):
            self.profile = cProfile.Profile() if len(times) == 4 else None
            if self.profile:
                self.profile.enable()
            self.start = time.process_time()

        def on_step_end(self, *args, **kwargs):
            times.append(time.process_time() - self.start)
            if self.profile:
                self.profile.disable()
                stats = pstats.Stats(self.profile).stats
                calls.update(total=sum(v[1] for v in stats.values()),
                             by_function={f"{os.path.basename(k[0])}:{k[2]}": v[1] for k, v in stats.items()})

    data = [{"input_ids": row, "labels": row}
            for row in torch.randint(0, MODEL["vocab_size"], (steps, TOKENS), generator=torch.Generator().manual_seed(0))]
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-5,
                  report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0, use_cpu=True,
                  bf16=True, disable_tqdm=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    if kind == "nxd_hf":
        _single_process()
        trainer = nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(tensor_parallel_size=1, **common),
                                    train_dataset=data, callbacks=[Timer()])
        _like_gpu()
    else:
        trainer = transformers.Trainer(model, transformers.TrainingArguments(**common), train_dataset=data,
                                       callbacks=[Timer()])
    trainer.train()
    timed = times[5:]  # warm-up and the profiled step dropped
    return {"calls": calls["total"], "calls_by_function": calls["by_function"], "cpu_s": timed}


def _trainer_pair(steps: int) -> dict:
    runs = {"plain": [], "nxd_hf": []}
    calls = {}
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
           "NXD_HF_BENCH_PORT": str(int(os.environ["MASTER_PORT"]) + 1)}  # this process's group holds its port
    for _ in range(2):
        for kind in runs:
            out = subprocess.run([sys.executable, "-m", "bench.host_step", "--trainer", kind, "--steps", str(steps)],
                                 check=True, capture_output=True, text=True, env=env)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[kind] += result["cpu_s"]
            calls[kind] = (result["calls"], result["calls_by_function"])
    return {kind: {"calls": calls[kind][0], "calls_by_function": calls[kind][1], **_spread(runs[kind])}
            for kind in runs}


def _most_extra(ours: dict, plain: dict, count: int = 8) -> dict:
    extra = sorted(((n - plain.get(f, 0), f) for f, n in ours.items() if n > plain.get(f, 0)), reverse=True)
    return {f: n for n, f in extra[:count]}


COLUMNS = [Column(title="case", width=10, left=True), Column(title="peer calls", width=10, spec=","),
           Column(title="nxd_hf calls", width=12, spec=","), Column(title="peer CPU ms", width=11, spec=".2f"),
           Column(title="nxd_hf CPU ms", width=13, spec=".2f"), Column(title="CPU ratio", width=9, spec=".3f"),
           Column(title="p10-p90 (nxd_hf)", width=16)]


def format_table(result: dict) -> str:
    rows = []
    for name, case in result["cases"].items():
        plain, ours = case["plain"], case["nxd_hf"]
        p10, p90 = ours["cpu_ms_p10_p90"]
        rows.append((name, plain["calls"], ours["calls"], plain["cpu_ms_median"], ours["cpu_ms_median"],
                     case["cpu_ratio"], f"{p10:.2f}-{p90:.2f}"))
    return "\n".join(table(COLUMNS, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="timed steps of each loop case")
    parser.add_argument("--steps", type=int, default=60, help="steps of each Trainer run")
    parser.add_argument("--trainer", choices=["plain", "nxd_hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trainer:
        result = _trainer_case(args.trainer, args.steps)
        print(json.dumps(result))
        return
    _single_process()
    cases = {name: _loop_case(adapters, args.rounds) for name, adapters in LOOP_CASES.items()}
    cases["trainer"] = _trainer_pair(args.steps)
    for case in cases.values():
        case["cpu_ratio"] = case["nxd_hf"]["cpu_ms_median"] / case["plain"]["cpu_ms_median"]
        case["calls_ratio"] = case["nxd_hf"]["calls"] / case["plain"]["calls"]
        case["most_extra_calls"] = _most_extra(case["nxd_hf"]["calls_by_function"], case["plain"]["calls_by_function"])
        for side in ("plain", "nxd_hf"):
            del case[side]["calls_by_function"]
    result = {**stamp(), "model": "the Llama-3.2-1B layer structure at hidden 16 (16 layers, tied head), 1 x 4 "
              "tokens, bf16 weights (Trainer: fp32 under bf16 autocast), one thread", "rounds": args.rounds,
              "trainer_steps": args.steps, "cases": cases}
    print(format_table(result))
    for name, case in cases.items():
        print(f"{name}: most extra calls", ", ".join(f"{f} +{n}" for f, n in case["most_extra_calls"].items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "host_step.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
