"""``initialize_parallel_model``: build the user's model the way ``nxd_config`` says and wrap
it in ``NxDModel``, which looks like the unwrapped model on this rank."""

import contextlib
import inspect
import math
import os
import time
from collections.abc import Mapping

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.model_state import NxDModelState, state_of
from nxd_hf.parallel_layers.loss_functions import loss_normalizer
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.parallelize import parallelize
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.trainer.config import NxDConfig
from nxd_hf.trainer.mean_loss import computes_own_mean_loss, label_weight
from nxd_hf.trainer.own_model import is_own_model, parallelize_own_model
from nxd_hf.utils import init_on_device


class NxDModel(nn.Module):
    """A parallelized model: ``run_train(**inputs)`` runs forward and backward (the pipeline
    schedule with PP) and returns the loss; parameter, buffer and module iterators cover this
    rank's part only, under the original model's names; ``config`` and ``dtype`` pass through.

    Loss: tokens are weighted over the whole step. Pass ``num_items_in_batch`` — the step's
    count of non-ignored label tokens summed over data-parallel ranks and micro-steps — when
    accumulating; by default it is this call's count over DP ranks. ``run_train`` returns this
    call's share of the step's mean loss (micro-steps' values add up to it), the same on every
    rank. A model whose forward computes its own mean loss (BERT's heads: ``own_mean_loss``,
    ``nxd_hf.trainer.mean_loss``) counts its labels unshifted."""

    def __init__(self, module: nn.Module, nxd_config: NxDConfig):
        super().__init__()
        self.module, self.nxd_config = module, nxd_config
        self.pipelined = isinstance(module, NxDPPModel)
        # a model nxd_hf sharded from a Hugging Face plan computes HF's loss over the step's tokens;
        # any other (nxd_hf.trainer.own_model) returns its own loss, as NxD's run_train takes it
        self.hf_loss = self.nxd is not None and self.nxd.patch is not None
        # a forward computing its own mean loss (nxd_hf.trainer.mean_loss; under PP the schedule
        # computes the model's loss_function)
        base = self.hf_model.get_base_model() if hasattr(self.hf_model, "get_base_model") else self.hf_model
        self.own_mean_loss = self.hf_loss and not self.pipelined and computes_own_mean_loss(base)
        if self.nxd is not None:
            self.nxd.attach_config(nxd_config)  # what save_checkpoint reads of the config (master weights, LoRA)

    @property
    def nxd(self) -> NxDModelState | None:
        """The wrapped model's setup record (``nxd_hf.model_state``)."""
        return state_of(self.module)

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model this wraps (under PP the original one: only local stages are real)."""
        return self.module.hf_model if self.pipelined else self.module

    def train(self, mode: bool = True) -> "NxDModel":
        self.training = mode
        for root in self._local_roots():  # children() lists the roots' children, not the roots
            root.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and the fp32 ``main_grad`` accumulators of this rank's parameters."""
        super().zero_grad(set_to_none)
        for param in self.parameters():
            if getattr(param, "main_grad", None) is not None:
                param.main_grad = None if set_to_none else param.main_grad.zero_()

    def no_sync(self):
        """Skip the data-parallel gradient reduction for backwards inside the block (accumulation), as DDP's."""
        return self.nxd.grad_reduction.no_sync()

    def local_module(self):
        if not self.pipelined:
            return self.module
        stages = self.module.local_modules()
        return stages[0] if len(stages) == 1 else stages

    def forward(self, *args, **kwargs):
        if self.pipelined:
            raise ValueError("a pipeline-parallel model runs through run_train/run_eval, not forward")
        return self.module(*args, **kwargs)

    def run_train(self, *args, **inputs):
        """Inputs by name, positionally (NxD's ``run_train(*args, **kwargs)``: in ``input_names``
        order under PP, else in the forward's order), or as one dict."""
        if self.pipelined:
            return self.module.run_train(*args, **inputs)
        inputs = self._named_inputs(args, inputs)
        if self.hf_loss:
            if "labels" not in inputs:
                raise ValueError(f"run_train needs labels to compute the loss; got only {sorted(inputs)}: pass "
                                 "labels=... (the input_ids, shifted inside the model, for a causal LM)")
            num_items_in_batch = inputs.pop("num_items_in_batch", None)
            if self.own_mean_loss:  # its mean over this replica's labels, weighted by their share
                loss = self.module(**inputs).loss * label_weight(inputs["labels"], total=num_items_in_batch)
            else:
                normalizer = loss_normalizer(inputs["labels"], num_items_in_batch)
                loss = self.module(**inputs, num_items_in_batch=normalizer).loss
        else:
            loss = loss_of(self.module(**inputs), type(self.nxd.hf_model).__name__)
        loss.backward()
        dp_size = parallel_state.get_data_parallel_size()
        share = loss.detach() / dp_size
        backend.all_reduce(share, parallel_state.get_data_parallel_group())
        return share

    def run_eval(self, *args, **inputs):
        if self.pipelined:
            return self.module.run_eval(*args, **inputs)
        inputs = self._named_inputs(args, inputs)
        with torch.no_grad():
            output = self.module(**inputs)
        return output.loss if self.hf_loss else loss_of(output, type(self.nxd.hf_model).__name__)

    def _named_inputs(self, args: tuple, inputs: dict) -> dict:
        if not args:
            return inputs
        if len(args) == 1 and isinstance(args[0], Mapping):
            return {**args[0], **inputs}
        signature = inspect.signature(self.module.forward)
        try:
            bound = signature.bind_partial(*args, **inputs).arguments
        except TypeError as error:
            raise ValueError(f"run_train/run_eval inputs do not fit the model's forward: {error}") from None
        named = {}
        for name, value in bound.items():
            kind = signature.parameters[name].kind
            if kind == inspect.Parameter.VAR_POSITIONAL:
                raise ValueError("run_train/run_eval take the model's named inputs; got more positional ones")
            named.update(value if kind == inspect.Parameter.VAR_KEYWORD else {name: value})
        return named

    # this rank's parameters, buffers and modules, under the original names
    def named_parameters(self, *args, **kwargs):
        if self.pipelined:
            return self.module.local_named_parameters(*args, **kwargs)
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self._over_local_roots("named_buffers", *args, **kwargs)

    def named_modules(self, *args, **kwargs):
        return self._over_local_roots("named_modules", *args, **kwargs)

    def named_children(self):
        return self._over_local_roots("named_children")

    def parameters(self, *args, **kwargs):
        return (value for _, value in self.named_parameters(*args, **kwargs))

    def buffers(self, *args, **kwargs):
        return (value for _, value in self.named_buffers(*args, **kwargs))

    def modules(self):
        return (value for _, value in self.named_modules())

    def children(self):
        return (value for _, value in self.named_children())

    def _over_local_roots(self, method: str, *args, **kwargs):
        for root in self._local_roots():
            yield from getattr(root, method)(*args, **kwargs)

    def _local_roots(self) -> list[nn.Module]:
        return self.module.local_modules() if self.pipelined else [self.module]

    @property
    def config(self):
        return self.module.config

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """The whole model as a plain HF model directory (every rank calls it; rank 0 writes)."""
        from nxd_hf.checkpoint import save_pretrained

        save_pretrained(self, save_directory, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def loss_of(output, model_name: str, caller: str = "run_train/run_eval") -> torch.Tensor:
    """The loss in what a model's forward returned: the output itself (a tensor), its ``loss``
    attribute or key (HF outputs, dicts)."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"{caller} takes the loss from {model_name}'s forward, which returned "
                         f"{type(output).__name__}: return the scalar loss, or an output with a 'loss' attribute or "
                         "key (pass the labels it needs)")
    return loss


def _build_in_waves(factor: int, build):
    """Run ``build()`` on at most ``factor`` ranks of this node at a time (waves separated by
    barriers); returns its result and this rank's (start, end) wall-clock times."""
    local_rank = int(os.environ.get("LOCAL_RANK", backend.rank()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", backend.world_size()))
    result, interval = None, None
    for wave in range(math.ceil(local_world / factor)):
        with fail_together("initialize_parallel_model (model_fn)"):  # also the barrier between waves
            if local_rank // factor == wave:
                start = time.time()
                result = build()
                interval = (start, time.time())
    return result, interval


def initialize_parallel_model(nxd_config: NxDConfig, model_fn, *model_args, **model_kwargs) -> NxDModel:
    """``model_fn(*model_args, **model_kwargs)``, built by at most ``sequential_move_factor``
    ranks of a node at a time (on the meta device with ``meta_device_init``), then tensor-,
    sequence- and pipeline-parallelized as configured (``nxd_hf.parallelize``'s setup sequence),
    with activation checkpointing and fp32 gradient accumulation for low-precision parameters.
    The optimizer from ``initialize_parallel_optimizer`` takes over the data-parallel reduction."""
    init = nxd_config.model_init_config

    def build():
        with init_on_device(torch.device("meta")) if init.meta_device_init else contextlib.nullcontext():
            return model_fn(*model_args, **model_kwargs)

    model, build_interval = _build_in_waves(init.sequential_move_factor, build)
    pp = nxd_config.pipeline_parallel_size
    pipeline_kwargs = {"broadcast_and_average_loss": True, **nxd_config.pipeline_config} if pp > 1 else {}
    if is_own_model(model):  # built from parallel layers, or plain: used as built (nxd_hf.trainer.own_model)
        wrapped = parallelize_own_model(model, nxd_config, pipeline_kwargs=pipeline_kwargs,
                                        param_init_fn=init.param_init_fn if init.meta_device_init else None)
        nxd_model = NxDModel(wrapped, nxd_config)
        nxd_model.build_interval = build_interval
        return nxd_model
    wrapped = parallelize(
        model, tensor_parallel_size=nxd_config.tensor_parallel_size, pipeline_parallel_size=pp,
        sequence_parallel=nxd_config.sequence_parallel, pad_model=nxd_config.pad_model,
        kv_size_multiplier=nxd_config.kv_size_multiplier,
        param_init_fn=init.param_init_fn if init.meta_device_init else None,
        activation_checkpoint_config=nxd_config.activation_checkpoint_config,
        fp32_grad_accumulation=nxd_config.mixed_precision_config.use_fp32_grad_acc,
        check_inputs=nxd_config.check_inputs, lora_config=nxd_config.lora_config,
        autocast_adapter_dtype=nxd_config.autocast_adapter_dtype, fused_loss=nxd_config.fused_loss,
        expert_parallel_size=nxd_config.expert_parallel_size,
        data_parallel_sharding=nxd_config.data_parallel_sharding, context_parallel_size=nxd_config.context_parallel_size,
        data_parallel_shard_size=nxd_config.data_parallel_shard_size,
        data_parallel_offload=nxd_config.data_parallel_offload,
        context_parallel_attention=nxd_config.context_parallel_attention, **pipeline_kwargs,
    )
    nxd_model = NxDModel(wrapped, nxd_config)
    nxd_model.build_interval = build_interval  # (start, end) of this rank's model_fn call
    return nxd_model

