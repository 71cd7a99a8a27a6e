"""One rank of ``bench/plan/run.py``: build each layout of its world on the meta device through
``nxd_hf.parallelize``, train a few steps while a thread samples RssAnon, count the last
step's collectives (``backend.count_comm``) and pipeline sends, and account the local parameters.

Every layout runs in the same ranks one after another; before each, everything of the last is
freed, the layout's model-parallel groups are created and glibc's heap trimmed, and the baseline
is read again (``MALLOC_MMAP_THRESHOLD_`` set
by the launcher makes every tensor its own mapping, returned to the kernel when freed)."""

import contextlib
import ctypes
import gc
import time

import torch
import torch.distributed as dist

from bench.memory.rank import PeakSampler, read_status
from nxd_hf.checkpoint.dp_shard import local_of
from bench.plan.models import MODELS


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _groups() -> dict[str, tuple]:
    from nxd_hf import parallel_state as ps

    # later axes win when two groups hold the same ranks (at tp = world the model group is the TP group)
    return {axis: tuple(dist.get_process_group_ranks(group())) for axis, group in (
        ("model", ps.get_model_parallel_group), ("dp", ps.get_data_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group), ("tp", ps.get_tensor_model_parallel_group))}


@contextlib.contextmanager
def count_sends(sends: list):
    """Record the bytes of every point-to-point send the pipeline schedules issue (all of them
    go through torch's ``schedules._batch_p2p``)."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def counted(ops, *args, **kwargs):
        sends.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops, *args, **kwargs)

    schedules._batch_p2p = counted
    try:
        yield
    finally:
        schedules._batch_p2p = original


def _init_weights(module) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.normal_(0.0, 0.02)


def build(case: dict):
    import peft
    import transformers

    import nxd_hf

    config = MODELS[case["model"]]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    kwargs = {}
    if case["pp"] > 1:
        kwargs = dict(num_microbatches=case["num_microbatches"], schedule=case["schedule"])
    lora = peft.LoraConfig(r=case["lora_r"], lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) \
        if case["lora"] else None
    torch.manual_seed(0)  # data-parallel replicas must start alike
    model = nxd_hf.parallelize(
        model, tensor_parallel_size=case["tp"], pipeline_parallel_size=case["pp"],
        sequence_parallel=case["sequence_parallel"], param_init_fn=_init_weights, check_inputs=False,
        activation_checkpoint_config="full" if case["recompute"] else None, lora_config=lora,
        data_parallel_sharding=case.get("data_parallel_sharding"), **kwargs)
    return config, model


def _optimizer(model, case: dict):
    params = [p for p in model.parameters() if p.requires_grad]
    if case["zero_1"]:
        from nxd_hf.optim import NeuronZero1Optimizer

        return NeuronZero1Optimizer(params, torch.optim.AdamW, lr=1e-4, grad_clipping=False, model=model)
    return torch.optim.AdamW(params, lr=1e-4)


def _step(model, optimizer, ids: torch.Tensor, pp: int) -> None:
    if pp > 1:
        model.run_train(input_ids=ids, labels=ids)
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_case(case: dict) -> dict:
    from nxd_hf import backend, parallel_state

    # the groups first: the baseline is a process ready to build this layout (gloo groups hold buffers)
    parallel_state.initialize_model_parallel(case["tp"], case["pp"])
    _trim()
    dist.barrier()
    baseline = read_status()["RssAnon"]
    times, cpu_times, sends = [], [], []
    with PeakSampler(interval_s=0.002) as sampler:
        config, model = build(case)
        if case.get("data_parallel_sharding"):
            # param_init_fn materializes each TP shard before FSDP2 shards it (from_pretrained reads into
            # the shards instead): the plan prices training, so the peak is taken from here on
            _trim()
            sampler.peak = read_status()
        optimizer = _optimizer(model, case)
        dp_rank = parallel_state.get_data_parallel_rank()
        rows = case["micro_batch"] * case.get("num_microbatches", 1)
        generator = torch.Generator().manual_seed(dp_rank)
        for step in range(case["steps"]):
            ids = torch.randint(0, config.vocab_size, (rows, case["seq"]), generator=generator)
            last = step == case["steps"] - 1
            start, cpu_start = time.perf_counter(), time.process_time()
            with backend.count_comm() as records, (count_sends(sends) if last else contextlib.nullcontext()):
                _step(model, optimizer, ids, case["pp"])
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    groups = _groups()
    axis = {ranks: name for name, ranks in groups.items()}  # the last axis of equal ranks wins
    comm = [dict(op=r.op, axis=axis.get(r.ranks, "other"), group_size=r.group_size, bytes=r.payload_bytes)
            for r in records]
    local = {id(p): local_of(p) for p in model.parameters()}  # FSDP2's DTensors: this rank's shard
    result = dict(
        rank=dist.get_rank(), baseline_anon=baseline, peak_anon=sampler.peak["RssAnon"], samples=sampler.samples,
        param_bytes=sum(p.numel() * p.element_size() for p in local.values()),
        trainable_bytes=sum(p.numel() * p.element_size() for p in local.values() if p.requires_grad),
        step_seconds=min(times[1:]),  # the least disturbed by the other work on a shared machine
        step_cpu_seconds=min(cpu_times[1:]),  # this process's CPU time: less sensitive to the machine's load
        comm=comm, p2p_send_bytes=sum(sends),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(), tp_rank=parallel_state.get_tensor_model_parallel_rank())
    del model, optimizer, records
    parallel_state.destroy_model_parallel()
    return result


def run_cases(cases: list[dict]) -> list[dict]:
    """Rank body: every case of this world, in order."""
    torch.set_num_threads(1)
    return [run_case(case) for case in cases]
