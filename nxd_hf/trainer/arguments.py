"""``NxDTrainingArguments``: ``transformers.TrainingArguments`` plus the parallel layout.

HF's fields keep HF's meaning; the table says what nxd_hf does with each one that matters:

================================  ===========================================================
``bf16``                          autocast to bf16 over fp32 weights, as ``Trainer`` does
``bf16_master_weights`` (ours)    bf16 parameters with fp32 master weights in the optimizer
``gradient_checkpointing`` /      activation checkpointing of every transformer layer
``activation_checkpointing``
``gradient_accumulation_steps``   honoured; loss weighted by tokens over the whole step
``max_grad_norm``                 clipping on the global norm of the whole (unsharded) model
``per_device_train_batch_size``   per data-parallel replica: a step's global batch is
                                  ``per_device_train_batch_size x dp x accumulation``
``seed``, ``data_seed``           as ``Trainer``: the same samples in the same order
``save_*``, ``eval_*``, logging   honoured
``use_cpu``                       accepted (CPU is used anyway without a GPU); refused with one
``fp16``                          refused: use ``bf16``
``deepspeed``                     refused: nxd_hf does the parallelism
``fsdp``, ``fsdp_config``         "full_shard" / "shard_grad_op": nxd_hf's ZeRO-3 / ZeRO-2 on FSDP2
                                  over its DP ranks (``nxd_hf.fsdp.hf_options``, docs/fsdp.md)
``torch_compile``                 honoured: the parallelized model is compiled (docs/gpu_speed.md)
``label_smoothing_factor``        honoured: smoothed in the vocab-parallel loss (no full logits)
``train_sampling_strategy``       "random" and "sequential"; others refused
``kv_size_multiplier`` (ours)     K/V head copies across TP ("auto": the fewest that fit)
``fused_loss`` (ours)             the loss from the hidden states, LM head fused in, in chunks
``expert_parallel_size`` (ours)   MoE experts split over that many data-parallel ranks
``num_microbatches``,             pipeline options: ignored, with a warning, at
``virtual_pipeline_size``,        ``pipeline_parallel_size=1``
``pipeline_schedule`` (ours)
================================  ===========================================================
"""

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
from typing import Literal

import torch
from transformers import TrainingArguments

from nxd_hf import backend
from nxd_hf.fsdp.hf_options import read_hf_fsdp
from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.trainer.config import NxDConfig, neuronx_distributed_config


AUTO_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")


@dataclasses.dataclass(kw_only=True)
class NxDTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with the parallel layout (see the module docstring for HF's fields)."""

    # typed str so that HfArgumentParser passes "auto" through; digits become ints in __post_init__
    tensor_parallel_size: str = dataclasses.field(default=1, metadata={
        "help": "Tensor-parallel degree, or 'auto' (chosen by nxd_hf.plan when NxDTrainer sets up the model)."})
    pipeline_parallel_size: str = dataclasses.field(default=1, metadata={
        "help": "Pipeline-parallel degree, or 'auto' (chosen by nxd_hf.plan when NxDTrainer sets up the model)."})
    num_microbatches: int | None = dataclasses.field(
        default=None, metadata={"help": "Pipeline microbatches per batch (default: the pipeline parallel size)."})
    virtual_pipeline_size: int = dataclasses.field(default=1, metadata={"help": "Pipeline stages per rank."})
    pipeline_schedule: str | None = dataclasses.field(
        default=None, metadata={"help": "1f1b, gpipe, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv."})
    sequence_parallel: bool = dataclasses.field(default=False, metadata={"help": "Sequence parallelism (decoders)."})
    zero_1: bool = dataclasses.field(default=False, metadata={"help": "Shard optimizer state over DP (ZeRO-1)."})
    kv_size_multiplier: str = dataclasses.field(
        default="auto", metadata={"help": "K/V head copies across TP: 'auto' or an integer."})
    pad_model: Literal["auto", "true", "false"] = dataclasses.field(
        default="auto", metadata={"help": "Pad attention heads when tp does not divide them: auto, true, false."})
    bf16_master_weights: bool = dataclasses.field(
        default=False, metadata={"help": "bf16 parameters with fp32 master weights in the optimizer."})
    fused_loss: bool = dataclasses.field(
        default=False, metadata={"help": "Causal-LM loss from the hidden states in chunks, the LM head fused in: "
                                         "the full logits are never held (docs/gpu_speed.md)."})
    expert_parallel_size: int = dataclasses.field(
        default=1, metadata={"help": "Ranks each mixture-of-experts layer's experts are split over, carved from the "
                                     "data-parallel ranks (docs/moe.md)."})
    data_parallel_sharding: str | None = dataclasses.field(
        default=None, metadata={"help": "zero3 or zero2 over the data-parallel ranks (FSDP2); set from fsdp= too."})
    data_parallel_shard_size: int | None = dataclasses.field(
        default=None, metadata={"help": "HSDP: shard over groups of this many DP ranks, replicate across them; set "
                                        "from fsdp='hybrid_shard' with fsdp_config dp_shard_size too."})
    data_parallel_offload: bool = dataclasses.field(
        default=False, metadata={"help": "Keep the FSDP2 shards in host memory (CPUOffloadPolicy); set from "
                                         "fsdp='full_shard offload' too."})
    context_parallel_size: int = dataclasses.field(
        default=1, metadata={"help": "Ranks each sequence is split over through attention, carved from the "
                                     "data-parallel ranks (docs/context_parallel.md)."})
    context_parallel_attention: Literal["auto", "ring", "all_to_all"] = dataclasses.field(
        default="auto", metadata={"help": "Attention across the context-parallel ranks: auto (ring), ring, all_to_all."})
    overlap_grad_reduce: bool = dataclasses.field(
        default=True, metadata={"help": "Reduce gradients over DP during backward, overlapped (ZeRO-1's reduce-scatter "
                                        "too), on the last micro-step of an accumulation only."})

    def __post_init__(self):
        self.use_cpu = _check_use_cpu(self.use_cpu)
        fsdp = read_hf_fsdp(self.fsdp, self.fsdp_config)  # nxd_hf shards over DP itself: accelerate must not
        self.fsdp, self.fsdp_config = None, None
        self.data_parallel_sharding = fsdp.data_parallel_sharding or self.data_parallel_sharding
        self.data_parallel_shard_size = fsdp.shard_size or self.data_parallel_shard_size
        self.data_parallel_offload = fsdp.offload or self.data_parallel_offload
        if self.data_parallel_sharding and self.zero_1:
            raise ValueError(f"NxDTrainingArguments: fsdp / data_parallel_sharding={self.data_parallel_sharding!r} "
                             "already shards the optimizer state over the data-parallel ranks: drop zero_1")
        _refuse_unsupported(self)
        checkpoint_layers = bool(self.activation_checkpointing or self.gradient_checkpointing
                                 or fsdp.activation_checkpointing)
        if "RANK" in os.environ:  # under torchrun: nxd_hf's backend ($NXD_HF_BACKEND honoured), not accelerate's
            backend.init_process_group_from_env(datetime.timedelta(seconds=self.ddp_timeout))  # as accelerate
        super().__post_init__()  # accelerate's device: cuda:LOCAL_RANK % GPUs on a GPU, as backend.default_device()
        # nxd_hf checkpoints layers in its setup sequence; Trainer must not call the model's own hook
        self.nxd_activation_checkpointing = checkpoint_layers
        self.activation_checkpointing = self.gradient_checkpointing = False
        self._check_layout()

    def _validate_args(self) -> None:
        if self.bf16 and not torch.cuda.is_available():
            # HF refuses bf16 on a CPU-only machine unless use_cpu, which nxd_hf drops (_check_use_cpu);
            # the autocast nxd_hf does runs on the CPU
            self.use_cpu = True
            try:
                super()._validate_args()
            finally:
                self.use_cpu = False
        else:
            super()._validate_args()

    def _check_layout(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "num_microbatches", "virtual_pipeline_size",
                     "expert_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if name == "num_microbatches" and value is None:
                continue
            if name in AUTO_SIZES and isinstance(value, str) and value.isdigit():  # from the command line
                value = int(value)
                setattr(self, name, value)
            if name in AUTO_SIZES and value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.has_auto_sizes:
            return  # checked once NxDTrainer resolves them (nxd_hf.plan.resolve_auto_sizes)
        self.parallel_sizes()  # the layout's own checks: the world divides into tp x pp, ep divides dp
        if self.kv_size_multiplier != "auto" and not str(self.kv_size_multiplier).isdigit():
            raise ValueError(f"kv_size_multiplier must be 'auto' or a positive integer, got {self.kv_size_multiplier!r}")
        if self.pipeline_parallel_size == 1:  # a value that changes nothing (the default, or 1) is not worth a warning
            for name, no_op in (("num_microbatches", (None, 1)), ("virtual_pipeline_size", (1,)),
                                ("pipeline_schedule", (None, ""))):
                if getattr(self, name) not in no_op:
                    backend.warn_once(f"{name} is ignored: pipeline_parallel_size is 1 (set pipeline_parallel_size > 1 "
                                      "for pipeline parallelism)", stacklevel=3)

    @property
    def has_auto_sizes(self) -> bool:
        """Whether a size is still "auto" (NxDTrainer resolves it from the model before setup)."""
        return any(getattr(self, name) == "auto" for name in AUTO_SIZES)

    def parallel_sizes(self) -> ParallelSizes:
        """The layout these arguments ask for on the launched world (``WORLD_SIZE``)."""
        if self.has_auto_sizes:
            raise ValueError("tensor/pipeline_parallel_size is 'auto': NxDTrainer resolves it from the model "
                             "(nxd_hf.plan.resolve_auto_sizes); give integers to read the sizes before")
        return ParallelSizes.for_world(int(os.environ.get("WORLD_SIZE", "1")), tp=self.tensor_parallel_size,
                                       pp=self.pipeline_parallel_size, ep=self.expert_parallel_size,
                                       cp=self.context_parallel_size)

    def use_sizes(self, sizes: ParallelSizes) -> None:
        """Record the sizes "auto" resolved to (``nxd_hf.plan.resolve_auto_sizes``' new value), so
        that these arguments read as the run they make; NxDTrainer calls it once, before setup."""
        assert sizes.ep == self.expert_parallel_size, (sizes, self.expert_parallel_size)
        self.tensor_parallel_size, self.pipeline_parallel_size = sizes.tp, sizes.pp
        self._check_layout()

    # -- the process view: every rank is a real process, whatever accelerate sees
    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        # transformers warns that the process group is not used for DDP: nxd_hf does the parallelism, not DDP
        with _filtered(logging.getLogger("transformers.training_args"), "parallel_mode != ParallelMode.DISTRIBUTED"):
            device = TrainingArguments._setup_devices.func(self)  # this rank's device, as accelerate places it
        one_process_view(self.distributed_state)
        return device

    @property
    def place_model_on_device(self) -> bool:
        return False  # nxd_hf's setup sequence places the model

    @property
    def should_log(self) -> bool:
        return backend.rank() == 0 if torch.distributed.is_initialized() else super().should_log

    @property
    def should_save(self) -> bool:
        return backend.rank() == 0 if torch.distributed.is_initialized() else super().should_save

    def nxd_config(self, *, lora_config=None) -> NxDConfig:
        """The configuration through NxD's config API (initializes model parallelism)."""
        pipeline_config = {}
        if self.pipeline_parallel_size > 1:
            pipeline_config = {"virtual_pipeline_size": self.virtual_pipeline_size}
            if self.num_microbatches is not None:
                pipeline_config["num_microbatches"] = self.num_microbatches
            if self.pipeline_schedule:
                pipeline_config["schedule"] = self.pipeline_schedule
        pad = {"auto": "auto", "true": True, "false": False}[str(self.pad_model).lower()]
        kv = "auto" if self.kv_size_multiplier == "auto" else int(self.kv_size_multiplier)
        config = neuronx_distributed_config(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            pipeline_config=pipeline_config, sequence_parallel=self.sequence_parallel, pad_model=pad,
            kv_size_multiplier=kv,
            optimizer_config={"zero_one_enabled": self.zero_1, "grad_clipping": self.max_grad_norm > 0,
                              "max_grad_norm": self.max_grad_norm if self.max_grad_norm > 0 else 1.0,
                              "overlap_grad_reduce": self.overlap_grad_reduce},
            activation_checkpoint_config="full" if self.nxd_activation_checkpointing else None,
            mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": self.bf16_master_weights},
            lora_config=lora_config, expert_parallel_size=self.expert_parallel_size,
            data_parallel_sharding=self.data_parallel_sharding,
            data_parallel_shard_size=self.data_parallel_shard_size, data_parallel_offload=self.data_parallel_offload,
            context_parallel_size=self.context_parallel_size,
            context_parallel_attention=self.context_parallel_attention,
        )
        config.fused_loss = self.fused_loss
        return config


def one_process_view(state) -> None:
    """Make accelerate's shared state (``PartialState``, read by ``AcceleratorState`` and
    ``args.world_size``) a single process on every rank, keeping this rank's device.

    NxDTrainer runs ``Trainer``'s loop on every rank as if it were alone: each rank draws the global
    batch and keeps its data-parallel slice, and evaluates the whole set. Where accelerate infers
    several processes (``MULTI_GPU`` under torchrun with a GPU; ``MULTI_CPU`` with
    ``ACCELERATE_USE_CPU``) it would shard every loader by process, so the ranks of one
    tensor-parallel group, and the pipeline stages, would get different batches; it would also sum
    the token count and gather the predictions over every rank. On a CPU without that, accelerate
    infers no distribution, as here. Called again before accelerate is used (``Trainer`` builds its
    ``Accelerator`` from the shared state, which any later ``TrainingArguments`` re-infers)."""
    from accelerate.utils import DistributedType

    # only the one-device-per-process types (XLA, and DeepSpeed/FSDP, which are refused, are left alone)
    if state is None or not state.distributed_type.value.startswith("MULTI_"):
        return
    state.distributed_type = DistributedType.NO
    state.num_processes, state.process_index, state.local_process_index = 1, 0, 0


@contextlib.contextmanager
def _filtered(logger: logging.Logger, text: str):
    """``logger`` drops the records holding ``text`` inside the block."""
    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _check_use_cpu(use_cpu: bool) -> bool:
    """``use_cpu=True`` would make accelerate wrap the model in DDP over every rank; without a GPU
    the CPU is used anyway, so it is dropped. With a GPU it is refused."""
    if use_cpu and torch.cuda.is_available():
        raise ValueError("use_cpu=True on a machine with a GPU is not supported by NxDTrainer: drop use_cpu, or "
                         "hide the GPUs (CUDA_VISIBLE_DEVICES='') to train on the CPU")
    return False


_REFUSED = {
    "fp16": "fp16 is not supported: use bf16=True (autocast) or bf16 parameters with bf16_master_weights=True",
    "deepspeed": "deepspeed is not used with NxDTrainer: nxd_hf does the parallelism (zero_1=True for ZeRO-1)",
}


def _refuse_unsupported(args: TrainingArguments) -> None:
    for name, message in _REFUSED.items():
        if getattr(args, name, None):
            raise ValueError(f"NxDTrainingArguments: {message}")
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by NxDTrainer: "
                         "use 'random' or 'sequential'")
