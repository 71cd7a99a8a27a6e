"""LoRA at tp=2 (nxd_hf + plain peft) beside full fine-tuning at tp=2 and plain peft LoRA in one
process, on a ~134M-parameter llama (hidden 768, 12 layers, vocab 32000), fp32, AdamW, gloo (CPU).

Per rank: trainable parameters (local elements), optimizer-state bytes after the first step
(checked exact: 8 B per local trainable element, adapters only when LoRA), peak resident set
above the bare-process baseline (``VmHWM`` reset after imports and process-group setup, minus
``VmRSS`` then; it covers building the model, the adapters and ``steps`` training steps), and
the median step time (forward + backward + optimizer step; the slowest rank per step). Every
case builds its model on the meta device and materializes only its own (local) parameters with
the same cheap random init, so no case ever holds more than its share of the weights.

Run from the repo root: ``python -m bench.lora [--out PATH] [--steps N]``.
"""

import argparse
import json
import statistics
import time

import torch

from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf.testing import run_distributed

CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
CASES = [("lora_tp2", 2), ("full_tp2", 2), ("peft_lora_1proc", 1)]
BATCH, SEQ = 2, 128


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _init(module) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False):
            param.fill_(1.0) if "norm" in type(module).__name__.lower() else param.normal_(0, 0.02)


def _build(case: str):
    import accelerate
    import peft
    import transformers

    import nxd_hf
    from nxd_hf.pipeline.local import materialize

    torch.manual_seed(0)
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    if case != "peft_lora_1proc":
        model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    materialize([model], _init)
    if case != "full_tp2":
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def worker(case: str, steps: int) -> dict:
    import nxd_hf  # noqa: F401  (imports before the baseline)
    import peft  # noqa: F401

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    baseline = _rss_bytes("VmRSS")
    model = _build(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    local_trainable = sum(p.numel() for p in trainable)
    assert state_bytes == 8 * local_trainable, (state_bytes, local_trainable)  # exp_avg + exp_avg_sq, fp32
    frozen_with_grad = [p for p in model.parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_with_grad
    return dict(trainable_params=local_trainable, total_params=sum(p.numel() for p in model.parameters()),
                state_bytes=state_bytes, peak_bytes=_rss_bytes("VmHWM") - baseline, step_s=times, losses=losses)


def run_case(case: str, world_size: int, steps: int) -> dict:
    ranks = run_distributed(worker, world_size, case, steps, timeout_s=1800)
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    return dict(case=case, world_size=world_size, per_rank=ranks,
                median_step_s=statistics.median(step_s[1:]) if steps > 1 else step_s[0])


def format_table(rows: list[dict]) -> str:
    lines = ["| case | ranks | trainable params / rank | optimizer state / rank | peak RSS above baseline / rank | step s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        r0 = row["per_rank"][0]
        peak = max(r["peak_bytes"] for r in row["per_rank"])
        lines.append(f"| {row['case']} | {row['world_size']} | {r0['trainable_params']:,} | "
                     f"{r0['state_bytes'] / 2**20:.1f} MiB | {peak / 2**20:.0f} MiB | {row['median_step_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    rows = [run_case(case, world_size, args.steps) for case, world_size in CASES]
    by_case = {row["case"]: row for row in rows}
    lora_peak = max(r["peak_bytes"] for r in by_case["lora_tp2"]["per_rank"])
    single_peak = by_case["peft_lora_1proc"]["per_rank"][0]["peak_bytes"]
    summary = dict(lora_tp2_peak_over_single_peft=lora_peak / single_peak, target=0.6)
    print(format_table(rows))
    print(f"LoRA tp=2 peak / single-process peft LoRA peak: {summary['lora_tp2_peak_over_single_peft']:.2f} "
          f"(aim <= {summary['target']})")
    with open(args.out, "w") as f:
        json.dump(dict(**stamp(), config=CONFIG, lora=LORA, batch=BATCH, seq=SEQ, steps=args.steps, rows=rows,
                       summary=summary), f, indent=1)
