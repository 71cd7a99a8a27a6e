"""NxD's configuration API: ``neuronx_distributed_config`` and its sub-configs.

Plain dicts are accepted for every sub-config, as in NxD; an unknown key or a value of the
wrong type is a ValueError naming the key and the accepted ones. Differences from NxD, on
purpose: ``pad_model`` defaults to "auto" (pad heads only when tp does not divide them;
False forbids padding).
"""

import dataclasses
import datetime
import typing
from collections.abc import Callable
from typing import Any, Literal

from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.setup_steps import init_parallel_state, requested_sizes


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    zero_one_enabled: bool = False
    """Shard optimizer state over data-parallel ranks (``NeuronZero1Optimizer``)."""
    grad_clipping: bool = True
    """Clip the global gradient norm in ``optimizer.step()``."""
    max_grad_norm: float = 1.0
    """The norm to clip to."""
    overlap_grad_reduce: bool = False
    """Reduce gradients over DP during backward, per bucket, overlapped with it (ZeRO-1's reduce-scatter too),
    not in ``optimizer.step()``; accumulation micro-steps must then run inside ``model.no_sync()`` (NxDTrainer
    does; not in NxD)."""


@dataclasses.dataclass(kw_only=True)
class ModelInitConfig:
    sequential_move_factor: int = 11
    """At most this many ranks of a node build their model at the same time (host memory); 1-32."""
    meta_device_init: bool = False
    """Build the model on the meta device; ``param_init_fn`` then initializes the local part."""
    param_init_fn: Callable | None = None
    """``fn(module)`` initializing a module's own parameters (needed with meta_device_init)."""


@dataclasses.dataclass(kw_only=True)
class MixedPrecisionConfig:
    use_master_weights: bool = True
    """Keep fp32 master copies of low-precision (bf16/fp16) parameters in the optimizer."""
    use_fp32_grad_acc: bool = True
    """Accumulate gradients of low-precision parameters in fp32 (``param.main_grad``)."""
    use_master_weights_in_ckpt: bool = False
    """Save the fp32 master weights in checkpoints instead of the low-precision ones."""


@dataclasses.dataclass(kw_only=True)
class NxDConfig:
    tensor_parallel_size: int = 1
    """Tensor-parallel degree."""
    pipeline_parallel_size: int = 1
    """Pipeline-parallel degree."""
    pipeline_config: dict = dataclasses.field(default_factory=dict)
    """``NxDPPModel`` keyword arguments (num_microbatches, schedule, pipeline_cuts, ...)."""
    optimizer_config: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """ZeRO-1 and gradient clipping."""
    activation_checkpoint_config: Any = None
    """None, "full" (every transformer layer) or a module class / list of classes to recompute."""
    pad_model: bool | Literal["auto"] = "auto"
    """Pad attention heads: "auto"/True when tp does not divide them; False forbids it."""
    sequence_parallel: bool = False
    """Split activations along the sequence between tensor-parallel regions."""
    model_init_config: ModelInitConfig = dataclasses.field(default_factory=ModelInitConfig)
    """How ranks build the model."""
    lora_config: Any = None
    """LoRA adapters: ``nxd_hf.modules.lora.LoraConfig`` (NxD's) or a ``peft.LoraConfig``."""
    autocast_adapter_dtype: bool = True
    """As ``peft.get_peft_model``'s: fp32 adapters on a bf16/fp16 model (False: the model's dtype; not in NxD)."""
    fused_loss: bool = False
    """The causal-LM loss from the hidden states, LM head fused in, in chunks (``parallelize``'s; not in NxD)."""
    mixed_precision_config: MixedPrecisionConfig = dataclasses.field(default_factory=MixedPrecisionConfig)
    """Master weights and fp32 gradient accumulation for bf16/fp16 models."""
    check_inputs: bool | Literal["always"] = True
    """Check input ranges and same-batch-per-TP/PP-group on the first step, every step or never (not in NxD)."""
    timeout: float | datetime.timedelta | None = None
    """Seconds a collective waits for the other ranks (None: torch's default, 30 min; not in NxD)."""
    kv_size_multiplier: int | Literal["auto"] = "auto"
    """Copies of each K/V head across TP ("auto": the fewest that fit; not in NxD, where it is an argument of
    ``GQAQKVColumnParallelLinear``)."""
    expert_parallel_size: int = 1
    """Ranks each mixture-of-experts layer's experts are split over, carved from the data-parallel ranks
    (``parallelize``'s; not in NxD)."""
    dummy_forward_args: dict | None = None
    """One small batch of the model's forward arguments by name: a plain PyTorch module at tp > 1 is traced on
    it to derive its tensor-parallel layout (``nxd_hf.trainer.own_layout``; nnScaler's; not in NxD)."""
    data_parallel_sharding: Literal["zero3", "zero2"] | None = None
    """ZeRO-3 / ZeRO-2 over the data-parallel ranks on FSDP2 (``parallelize``'s; docs/fsdp.md; not in NxD)."""
    data_parallel_shard_size: int | None = None
    """With data_parallel_sharding, HSDP: shard over groups of this many DP ranks (``parallelize``'s; not in NxD)."""
    data_parallel_offload: bool = False
    """With data_parallel_sharding, the shards in host memory (FSDP2's CPUOffloadPolicy; not in NxD)."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over through attention, carved from the data-parallel ranks (not in NxD)."""
    context_parallel_attention: Literal["auto", "ring", "all_to_all"] = "auto"
    """Attention across the context-parallel ranks (``parallelize``'s; not in NxD)."""

    def __getitem__(self, key: str):  # NxD hands the config around as a dict
        return getattr(self, key)

    def parallel_sizes(self) -> ParallelSizes:
        """The layout this config asks for on the launched world (torch.distributed is initialized
        from the torchrun environment to know its size; building the config creates nothing)."""
        return requested_sizes(tensor_parallel_size=self.tensor_parallel_size,
                               pipeline_parallel_size=self.pipeline_parallel_size,
                               expert_parallel_size=self.expert_parallel_size, timeout=self.timeout,
                               context_parallel_size=self.context_parallel_size)


def _check_type(owner: str, key: str, value, annotation) -> None:
    origin = typing.get_origin(annotation)
    if annotation is Any or (origin is None and annotation is Callable):
        return
    allowed = typing.get_args(annotation) if origin in (typing.Union, type(int | None)) else (annotation,)
    ok = False
    for option in allowed:
        if typing.get_origin(option) is Literal:
            ok = ok or value in typing.get_args(option)
        elif option is type(None):
            ok = ok or value is None
        elif option is float:
            ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool))
        elif option is Callable or typing.get_origin(option) is Callable:
            ok = ok or callable(value)
        elif option is int:
            ok = ok or (isinstance(value, int) and not isinstance(value, bool))
        else:
            ok = ok or isinstance(value, typing.get_origin(option) or option)
    if not ok:
        raise ValueError(f"{owner}[{key!r}] = {value!r} has the wrong type: expected {annotation}")


def _build(cls, value, owner: str):
    """A ``cls`` from a dict (or an instance), checking keys and types."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{owner} must be a dict, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(value) - set(hints))
    if unknown:
        raise ValueError(f"unknown {owner} key(s) {unknown}; accepted: {sorted(hints)}")
    for key, item in value.items():
        _check_type(owner, key, item, hints[key])
    return cls(**value)


def neuronx_distributed_config(
    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, pipeline_config: dict | None = None,
    optimizer_config: dict | None = None, activation_checkpoint_config=None, pad_model: bool | str = "auto",
    sequence_parallel: bool = False, model_init_config: dict | None = None, lora_config=None,
    mixed_precision_config: dict | None = None, *, check_inputs: bool | str = True, timeout=None,
    kv_size_multiplier: int | str = "auto", expert_parallel_size: int = 1, dummy_forward_args: dict | None = None,
    data_parallel_sharding: str | None = None, context_parallel_size: int = 1, context_parallel_attention: str = "auto",
    data_parallel_shard_size: int | None = None, data_parallel_offload: bool = False,
) -> NxDConfig:
    """Validate the training configuration and initialize model parallelism (see ``NxDConfig``).

    As NxD documents, this function (not ``NxDConfig`` itself) makes the process groups: through
    the setup sequence's step 0 (``setup_steps.init_parallel_state``), replacing any earlier ones;
    ``initialize_parallel_model`` then finds them made for the same sizes."""
    config = NxDConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        pipeline_config=dict(pipeline_config or {}),
        optimizer_config=_build(OptimizerConfig, optimizer_config, "optimizer_config"),
        activation_checkpoint_config=activation_checkpoint_config, pad_model=pad_model,
        sequence_parallel=sequence_parallel,
        model_init_config=_build(ModelInitConfig, model_init_config, "model_init_config"),
        lora_config=lora_config,
        mixed_precision_config=_build(MixedPrecisionConfig, mixed_precision_config, "mixed_precision_config"),
        check_inputs=check_inputs, timeout=timeout, kv_size_multiplier=kv_size_multiplier,
        expert_parallel_size=expert_parallel_size, dummy_forward_args=dummy_forward_args,
        data_parallel_sharding=data_parallel_sharding, context_parallel_size=context_parallel_size,
        context_parallel_attention=context_parallel_attention, data_parallel_shard_size=data_parallel_shard_size,
        data_parallel_offload=data_parallel_offload,
    )
    hints = typing.get_type_hints(NxDConfig)
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "pad_model", "sequence_parallel", "check_inputs",
                "timeout", "kv_size_multiplier", "expert_parallel_size", "dummy_forward_args", "data_parallel_sharding",
                "context_parallel_size", "context_parallel_attention", "data_parallel_shard_size",
                "data_parallel_offload"):
        _check_type("neuronx_distributed_config", key, getattr(config, key), hints[key])
    _check_pipeline_config(config.pipeline_config)
    if not 1 <= config.model_init_config.sequential_move_factor <= 32:
        raise ValueError("model_init_config['sequential_move_factor'] must be in 1..32")
    if config.model_init_config.meta_device_init and config.model_init_config.param_init_fn is None:
        raise ValueError("model_init_config: meta_device_init=True needs a param_init_fn")
    if lora_config is not None and type(lora_config).__name__ != "LoraConfig":
        raise ValueError(f"lora_config must be nxd_hf.modules.lora.LoraConfig (or a peft.LoraConfig), "
                         f"got {type(lora_config).__name__}")
    if data_parallel_sharding is not None and config.optimizer_config.zero_one_enabled:
        raise ValueError(f"data_parallel_sharding={data_parallel_sharding!r} already shards the optimizer state over "
                         "the data-parallel ranks: drop optimizer_config zero_one_enabled")
    if config.pipeline_config and pipeline_parallel_size == 1:
        raise ValueError("pipeline_config is given but pipeline_parallel_size is 1: set pipeline_parallel_size > 1")
    init_parallel_state(config.parallel_sizes(), timeout, replace=True)
    return config


def _check_pipeline_config(pipeline_config: dict) -> None:
    import inspect

    from nxd_hf.pipeline.model import NxDPPModel

    elsewhere = {"param_init_fn": "model_init_config", "activation_checkpoint_config": "neuronx_distributed_config"}
    for key, home in elsewhere.items():
        if key in pipeline_config:
            raise ValueError(f"pipeline_config[{key!r}]: pass {key} in {home} instead")
    accepted = set(inspect.signature(NxDPPModel.__init__).parameters) - {"self", "module", "setup", *elsewhere}
    unknown = sorted(set(pipeline_config) - accepted)
    if unknown:
        raise ValueError(f"unknown pipeline_config key(s) {unknown}; accepted: {sorted(accepted)}")
