"""One layout's measurement beside the plan's prediction (``bench/plan/run.py``)."""

import os

from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.plan.activations import trace_activations
from nxd_hf.plan.api import load_config
from nxd_hf.plan.cluster import PRESETS, make_cluster
from nxd_hf.plan.layout import Layout
from nxd_hf.plan.memory import Workload, rank_memory
from nxd_hf.plan.search import predict
from nxd_hf.plan.shapes import meta_model, model_shape, rank_params
from nxd_hf.plan.step_comm import step_terms

from bench.plan.models import MODELS

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def layout_of(case: dict) -> Layout:
    return Layout(sizes=ParallelSizes(tp=case["tp"], pp=case["pp"], dp=case["dp"]),
                  sequence_parallel=case["sequence_parallel"],
                  zero_1=case["zero_1"], num_microbatches=case["num_microbatches"], schedule=case["schedule"],
                  recompute=case["recompute"], data_parallel_sharding=case.get("data_parallel_sharding"))


def _lora_config(case: dict):
    if not case["lora"]:
        return None
    import peft

    return peft.LoraConfig(r=case["lora_r"], lora_alpha=16, target_modules=list(LORA_TARGETS))


def _by_axis_op(items) -> dict:
    out = {}
    for axis, op, nbytes in items:
        out[f"{axis}:{op}"] = out.get(f"{axis}:{op}", 0) + nbytes
    return out


def compare_case(case: dict, ranks: list[dict]) -> dict:
    config = load_config(MODELS[case["model"]]())
    model = meta_model(config)
    shape = model_shape(config, model)
    layout = layout_of(case)
    work = Workload(micro_batch_size=case["micro_batch"], seq_len=case["seq"],
                    global_batch_size=case["micro_batch"] * case["num_microbatches"] * case["dp"],
                    lora_r=case["lora_r"] if case["lora"] else 0, lora_targets=LORA_TARGETS if case["lora"] else ())
    counts = rank_params(config, model, tp=layout.tp, lora_config=_lora_config(case))
    trace = trace_activations(config, micro_batch_size=work.micro_batch_size, seq_len=work.seq_len,
                              lora_config=_lora_config(case), device="cpu")
    world = layout.tp * layout.pp * layout.dp
    # this machine: ranks beyond its cores share them
    cluster = make_cluster(world_size=world, device_memory="24GiB", preset="cpu",
                           flops=PRESETS["cpu"]["flops"] * min(1.0, (os.cpu_count() or 1) / world))
    whole = predict(shape, counts, work, layout, cluster, trace=trace)
    out = []
    for r in ranks:
        memory = rank_memory(shape, counts, work, layout, r["pp_rank"], trace=trace)
        terms = step_terms(shape, counts, work, layout, r["pp_rank"], trace=trace)
        # FSDP2's all-gathers and reduce-scatters are torch's own: ``backend.count_comm`` does not see them
        predicted_comm = _by_axis_op((t.axis, t.op, t.payload_bytes) for t in terms if t.phase != "fsdp")
        measured = _by_axis_op((c["axis"], c["op"], c["bytes"]) for c in r["comm"])
        if r["p2p_send_bytes"]:
            measured["pp:send"] = r["p2p_send_bytes"]
        predicted_params = memory["parameters"] + memory["lora"]
        measured_peak = r["peak_anon"] - r["baseline_anon"]
        out.append(dict(rank=r["rank"], pp_rank=r["pp_rank"], predicted=memory, predicted_peak=memory["peak"],
                        measured_peak=measured_peak, memory_ratio=measured_peak / memory["peak"],
                        predicted_param_bytes=predicted_params, measured_param_bytes=r["param_bytes"],
                        param_bytes_equal=_params_equal(predicted_params, r["param_bytes"], case),
                        predicted_comm=predicted_comm, measured_comm=measured, comm_equal=predicted_comm == measured,
                        step_seconds=r["step_seconds"]))
    return dict(model=case["model"], layout=layout.name() + (" lora" if case["lora"] else ""), case=case,
                predicted_step_s=whole.step_time, measured_step_s=max(r["step_seconds"] for r in ranks),
                measured_step_cpu_s=max(r.get("step_cpu_seconds", 0.0) for r in ranks), ranks=out)


def _params_equal(predicted: float, measured: int, case: dict) -> bool:
    """Byte for byte; under FSDP2 within its row padding: the plan counts total / dp, a rank holds
    ceil(rows / dp) rows of each tensor (the last rank fewer)."""
    if not case.get("data_parallel_sharding"):
        return predicted == measured
    return abs(predicted - measured) <= 0.01 * predicted


def measured_ranks(row: dict) -> list[dict]:
    """A saved row's measurements in the form ``compare_case`` takes (to re-predict a saved run)."""
    ranks = []
    for r in row["ranks"]:
        comm = [dict(axis=key.split(":")[0], op=key.split(":")[1], bytes=nbytes)
                for key, nbytes in r["measured_comm"].items() if key != "pp:send"]
        ranks.append(dict(rank=r["rank"], pp_rank=r["pp_rank"], peak_anon=r["measured_peak"], baseline_anon=0,
                          comm=comm, p2p_send_bytes=r["measured_comm"].get("pp:send", 0),
                          param_bytes=r["measured_param_bytes"], step_seconds=r["step_seconds"],
                          step_cpu_seconds=row["measured_step_cpu_s"]))
    return ranks


def pairs_ordered(predicted: list[float], measured: list[float], apart: float = 1.25) -> tuple[int, int]:
    """(pairs of layouts whose measured times differ by at least ``apart`` x, how many of them the
    prediction orders the same way): the ranking where the difference is large, which noise
    between near-equal layouts cannot flip."""
    pairs = [(i, j) for i in range(len(measured)) for j in range(i + 1, len(measured))
             if max(measured[i], measured[j]) >= apart * min(measured[i], measured[j])]
    return len(pairs), sum((predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0 for i, j in pairs)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0
