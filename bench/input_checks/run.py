"""``python -m bench.input_checks`` (this module): the cost of the every-step input checks on CPU.

Two gloo ranks at tp=2 train the same small Llama twice, ``check_inputs=True`` (the device range
checks in the embedding and the loss, and the batch fingerprint all-reduced every step) and
``check_inputs=False`` (none), in alternating blocks of steps so that load on the machine falls
on both alike. Writes the median step time, its spread (10th-90th percentile) and the ratio to
``bench/results/input_checks.json``.
"""

import json
import os
import statistics
import time

import torch
import transformers

ROUNDS, STEPS, WARMUP = 5, 12, 3
BATCH, SEQ = 4, 128


def _model(check_inputs):
    import nxd_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                      num_key_value_heads=4, num_hidden_layers=4, vocab_size=4001)
    model = transformers.LlamaForCausalLM(config)
    model = nxd_hf.parallelize(model, tensor_parallel_size=2, check_inputs=check_inputs)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _steps(model, optimizer, n, generator) -> list[float]:
    times = []
    for _ in range(n):
        ids = torch.randint(0, 4001, (BATCH, SEQ), generator=generator)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def rank_main() -> dict:
    models = {"checked": _model(True), "unchecked": _model(False)}
    times = {name: [] for name in models}
    for round_ in range(ROUNDS):
        for name, (model, optimizer) in (models.items() if round_ % 2 == 0 else reversed(models.items())):
            generator = torch.Generator().manual_seed(round_)  # the same batches on both ranks
            _steps(model, optimizer, WARMUP if round_ == 0 else 0, generator)
            times[name] += _steps(model, optimizer, STEPS, generator)
    return times


def _summary(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=10)
    return {"median_ms": round(1e3 * statistics.median(values), 2), "p10_ms": round(1e3 * q[0], 2),
            "p90_ms": round(1e3 * q[-1], 2), "steps": len(values)}


def main() -> None:
    from nxd_hf.testing import run_distributed

    times = run_distributed(rank_main, 2)[0]
    checked, unchecked = _summary(times["checked"]), _summary(times["unchecked"])
    result = {"what": "tp=2 step (forward+backward+SGD) of a 4-layer Llama (h=256, vocab 4001), batch 4x128, "
                      "2 gloo CPU ranks; blocks of steps alternated",
              "check_inputs=True": checked, "check_inputs=False": unchecked,
              "median_ratio": round(checked["median_ms"] / unchecked["median_ms"], 4),
              "load_avg_1min": os.getloadavg()[0], "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    out = os.path.join(os.path.dirname(__file__), "..", "results", "input_checks.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)

