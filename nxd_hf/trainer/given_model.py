"""The model handed to ``NxDTrainer``: "auto" sizes resolved for it, an already parallel one
checked against the arguments' layout, this rank's modules placed where ``Trainer`` puts the
batches."""

import torch

from nxd_hf import parallel_state
from nxd_hf.model_state import state_of
from nxd_hf.parallel_layers.sharding import move_model_to_device
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.trainer.arguments import NxDTrainingArguments
from nxd_hf.trainer.model import NxDModel


def place_model(nxd_model: NxDModel, device) -> None:
    """This rank's modules on ``args.device``, where ``Trainer`` puts the batches (``Trainer``
    itself moves the model there; ``place_model_on_device`` is off for NxDTrainer because the
    setup sequence must run first). Under torchrun and nccl that is the setup's own default,
    ``cuda:LOCAL_RANK``; an already parallel model, or a layout built elsewhere, is moved here."""
    device = torch.device(device)
    for root in nxd_model._local_roots():
        if any(t.device.type != device.type or (device.index is not None and t.device != device)
               for t in (*root.parameters(), *root.buffers())):
            move_model_to_device(root, device)


def resolve_auto_sizes(args: NxDTrainingArguments, model, peft_config) -> None:
    """tensor/pipeline_parallel_size="auto": the best layout ``nxd_hf.plan`` finds for this model,
    the world size, this device's memory and the arguments' batch; the arguments record it."""
    if model is None or is_parallel(model) or not hasattr(model, "config"):
        raise ValueError("tensor_parallel_size/pipeline_parallel_size='auto' needs the plain HF model passed as "
                         "model= (not model_init, not an already parallel model): give the sizes as integers")
    from nxd_hf.plan.auto import resolve_auto_sizes as plan_sizes

    sizes = plan_sizes(
        model, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        expert_parallel_size=args.expert_parallel_size, context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel, zero_1=args.zero_1,
        recompute=args.nxd_activation_checkpointing, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, lora_config=peft_config,
        data_parallel_sharding=args.data_parallel_sharding)
    from nxd_hf.utils.logger import get_logger

    chosen = {name: getattr(sizes, axis) for name, axis in (("tensor_parallel_size", "tp"),
                                                            ("pipeline_parallel_size", "pp"))
              if getattr(args, name) == "auto"}
    get_logger().info(f"nxd_hf.plan chose {chosen} for the 'auto' sizes")
    args.use_sizes(sizes)


def is_parallel(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(model, (NxDModel, NxDPPModel)) or state_of(base) is not None


def check_layout(args: NxDTrainingArguments, *, pipelined: bool) -> None:
    """An already parallel model must have the layout the arguments ask for."""
    have = (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size(),
            parallel_state.get_expert_parallel_size())
    want = (args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size)
    if have != want or pipelined != (args.pipeline_parallel_size > 1):
        ep = f" (expert_parallel_size {have[2]}, the arguments {want[2]})" if have[2] != want[2] else ""
        raise ValueError(f"the model is parallelized with tp={have[0]}, pp={have[1]} but the arguments ask for "
                         f"tp={want[0]}, pp={want[1]}{ep}: pass the plain HF model and let NxDTrainer parallelize it")
