"""The plan behind ``tensor_parallel_size="auto"`` / ``pipeline_parallel_size="auto"``
(``NxDTrainingArguments``) and nnScaler's ``pas_policy="autodist"`` (``autodist_policy``)."""

import os

import torch

from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.plan.api import plan

AUTO = "auto"


def device_memory_bytes(device: torch.device | str | None = None) -> int:
    """Memory one rank may use: a GPU's total memory, or on a CPU the available RAM shared by the
    ranks of this host (``LOCAL_WORLD_SIZE``)."""
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device or torch.cuda.current_device()).total_memory
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _preset() -> str:
    return "h100" if torch.cuda.is_available() else "cpu"


def resolve_auto_sizes(model, *, tensor_parallel_size: int | str, pipeline_parallel_size: int | str,
                       expert_parallel_size: int = 1, context_parallel_size: int = 1,
                       sequence_parallel: bool = False, zero_1: bool = False,
                       recompute: bool = False, micro_batch_size: int = 1, gradient_accumulation_steps: int = 1,
                       lora_config=None, world_size: int | None = None, device_memory: int | None = None,
                       seq_len: int | None = None, data_parallel_sharding: str | None = None) -> ParallelSizes:
    """The ``ParallelSizes`` with "auto" in ``tensor_parallel_size`` / ``pipeline_parallel_size``
    replaced by the best layout's; the other sizes given, sequence parallelism, ZeRO-1,
    ``data_parallel_sharding`` (FSDP2's "zero3"/"zero2") and recomputation stay as asked (the plan
    prices the run they make; ``context_parallel_size`` too: the CP ranks of a replica share its
    rows and split its sequences). The sequence length is
    ``seq_len`` or the model's ``max_position_embeddings`` (capped at 4096)."""
    ParallelSizes.check_sizes(cp=context_parallel_size)
    world = world_size or int(os.environ.get("WORLD_SIZE", 1))
    asked = {"tp": tensor_parallel_size, "pp": pipeline_parallel_size}
    fixed = {axis: int(size) for axis, size in asked.items() if size != AUTO}
    if len(fixed) < len(asked):
        config = model.config
        fixed.update(sequence_parallel=bool(sequence_parallel), zero_1=bool(zero_1), recompute=bool(recompute),
                     data_parallel_sharding=data_parallel_sharding, cp=context_parallel_size)
        seq = seq_len or min(getattr(config, "max_position_embeddings", 2048) or 2048, 4096)
        result = plan(model, world_size=world, device_memory=device_memory or device_memory_bytes(), seq_len=seq,
                      micro_batch_size=micro_batch_size,
                      global_batch_size=micro_batch_size * (world // context_parallel_size)
                      * gradient_accumulation_steps,
                      lora_config=lora_config, device=_preset(), fixed=fixed)
        try:
            best = result.best.layout
        except ValueError as error:
            raise ValueError(f"tensor/pipeline_parallel_size='auto': {error}") from None
        fixed.update(tp=best.tp, pp=best.pp)
    return ParallelSizes.for_world(world, tp=fixed["tp"], pp=fixed["pp"], ep=expert_parallel_size,
                                   cp=context_parallel_size)


def autodist_policy(module, *, world_size: int, device_memory: int | str | None = None, seq_len: int,
                    micro_batch_size: int = 1, global_batch_size: int | None = None, lora_config=None,
                    **plan_kwargs) -> dict:
    """nnScaler's ``pas_policy="autodist"``: the plan's best layout for an HF ``module`` as the
    sizes nnScaler's ``ComputeConfig`` and nxd_hf's ``parallelize`` take (``plan_ngpus`` = tp x pp,
    ``runtime_ngpus`` = world size), with the ranked ``PlanResult`` under "plan"."""
    result = plan(module, world_size=world_size, device_memory=device_memory or device_memory_bytes(),
                  seq_len=seq_len, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                  lora_config=lora_config, **{"device": _preset(), **plan_kwargs})
    best = result.best.layout
    return dict(tensor_parallel_size=best.tp, pipeline_parallel_size=best.pp, data_parallel_size=best.dp,
                expert_parallel_size=best.ep, sequence_parallel=best.sequence_parallel, zero_1=best.zero_1,
                num_microbatches=best.num_microbatches, schedule=best.schedule,
                virtual_pipeline_size=best.virtual_stages,
                activation_checkpoint_config="full" if best.recompute else None,
                plan_ngpus=best.tp * best.pp, runtime_ngpus=world_size, plan=result)
