"""``nxd_hf.plan.plan(...)`` (also ``nxd_hf.plan_layout``): read the model, describe the cluster and
the workload, search."""

import os

import torch

from nxd_hf.plan.cluster import make_cluster
from nxd_hf.plan.memory import Workload
from nxd_hf.plan.search import PlanResult, search
from nxd_hf.plan.shapes import meta_model, model_shape

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def load_config(model_or_config):
    """A transformers config from a model, a config, or a directory/file holding config.json."""
    import transformers

    if isinstance(model_or_config, transformers.PretrainedConfig):
        return model_or_config
    if hasattr(model_or_config, "config") and isinstance(model_or_config.config, transformers.PretrainedConfig):
        return model_or_config.config
    if isinstance(model_or_config, (str, os.PathLike)):
        if not os.path.exists(model_or_config):
            raise ValueError(f"{model_or_config!r} does not exist: pass a model directory holding config.json "
                             "(no download is made), a transformers config or a model")
        return transformers.AutoConfig.from_pretrained(model_or_config)
    raise ValueError(f"cannot read a model config from a {type(model_or_config).__name__}: pass a model directory, "
                     "a transformers config or a model")


def _lora_targets(lora_config) -> tuple[str, ...]:
    target = lora_config.target_modules
    if target is None or target == "all-linear":
        return _PROJECTIONS
    if isinstance(target, str):
        return tuple(p for p in _PROJECTIONS if p in target)
    return tuple(p for p in _PROJECTIONS if p in set(target))


def dtype_bytes(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one the plan knows: use float32 or bfloat16")
    return _DTYPE_BYTES[name]


def plan(model_or_config, *, world_size: int, device_memory: int | str, seq_len: int, micro_batch_size: int = 1,
         global_batch_size: int | None = None, lora_config=None, dtype: str | torch.dtype = "float32",
         nodes: int = 1, device: str = "h100", flops: float | None = None, intra_bandwidth: float | None = None,
         inter_bandwidth: float | None = None, intra_latency: float | None = None,
         inter_latency: float | None = None, memory_margin: float = 0.1, fixed: dict | None = None) -> PlanResult:
    """Rank the layouts nxd_hf can run this model with on ``world_size`` ranks of ``device_memory``
    (bytes or "80GB"). ``global_batch_size`` defaults to ``micro_batch_size`` x the largest dp;
    ``device`` picks the speed preset (``nxd_hf.plan.cluster.PRESETS``: h100, a100, trn1, cpu),
    the other speed arguments override it; ``fixed`` keeps some Layout fields (``{"tp": 2}``).
    Returns a ``PlanResult``: ``ranked`` (best first), ``rejected`` (with reasons), ``best``."""
    for name, value in (("world_size", world_size), ("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    config = load_config(model_or_config)
    cluster = make_cluster(world_size=world_size, device_memory=device_memory, preset=device, nodes=nodes,
                           flops=flops, intra_bandwidth=intra_bandwidth, inter_bandwidth=inter_bandwidth,
                           intra_latency=intra_latency, inter_latency=inter_latency)
    work = Workload(micro_batch_size=micro_batch_size, seq_len=seq_len,
                    global_batch_size=global_batch_size or micro_batch_size * world_size,
                    param_bytes=dtype_bytes(dtype), lora_r=lora_config.r if lora_config is not None else 0,
                    lora_targets=_lora_targets(lora_config) if lora_config is not None else ())
    model = meta_model(config)
    shape = model_shape(config, model)
    return search(config, model, shape, work, cluster, lora_config=lora_config, memory_margin=memory_margin,
                  fixed=fixed)
