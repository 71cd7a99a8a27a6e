"""The config API's path for a model that no Hugging Face plan shards: one the user wrote with
nxd_hf's parallel layers (NxD's own way: ``ColumnParallelLinear``, ``RowParallelLinear``,
``ParallelEmbedding``, ``parallel_cross_entropy``), or a plain PyTorch module.

Such a model skips ``nxd_hf.parallelize``'s Hugging Face steps 1-3 (patch, head padding, layer
swap): its layers are used as built, never sharded a second time. It runs the generic steps
only: the pipeline split (``NxDPPModel`` with ``pipeline_config``'s ``transformer_layer_cls``,
``input_names``, ``output_loss_value_spec``, ``tracer_cls``) when pp > 1, then steps 5-10
(``nxd_hf.model_setup``: weights, LoRA adapters on the layers ``lora_config.target_modules`` names,
activation checkpointing, gradient reduction, device).
A plain module at tp > 1 is sharded as ``nxd_hf.nnscaler`` shards one: its layout derived from its
traced graph on ``dummy_forward_args`` (``nxd_hf.trainer.own_layout``), exact, the layers without
an exact split replicated (a warning names them); at pp > 1 the layout is derived inside each
transformer layer (``shard_plain_layers``), then the pipeline cuts the module between them."""

import functools
import warnings

from torch import nn

from nxd_hf.guards.fail_together import fail_together
from nxd_hf.guards.input_check import InputCheck, resolve_mode
from nxd_hf.model_setup import LocalSetup, SetupRecord, finish_parallel_model
from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
from nxd_hf.lora.setup import setup_lora
from nxd_hf.model_state import state_of
from nxd_hf.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.trainer.own_layout import shard_plain_layers, shard_plain_module


def is_own_model(model: nn.Module) -> bool:
    """Whether the config API takes ``model`` as its user built it: it holds nxd_hf parallel
    layers (already sharded, whatever its class), or it is not a Hugging Face model."""
    return not hasattr(model, "config") or has_parallel_layers(model)


def has_parallel_layers(model: nn.Module) -> bool:
    """A layer that is sharded over tensor-parallel ranks when built (its parameters carry the
    sharding metadata: ``modules.qkv_linear`` and the rest build on the same attributes)."""
    return any(isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding)) for m in model.modules()) \
        or any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())


def parallelize_own_model(model: nn.Module, nxd_config, *, param_init_fn, pipeline_kwargs: dict) -> nn.Module:
    """``model`` set up as the module docstring says; returns it (pp=1) or its ``NxDPPModel``."""
    tp, pp = nxd_config.tensor_parallel_size, nxd_config.pipeline_parallel_size
    with fail_together("initialize_parallel_model (a model built from parallel layers or plain)"):
        _check_options(model, nxd_config)
        check = InputCheck(vocab_size=None, mode=resolve_mode(nxd_config.check_inputs))  # TP/PP ranks: the same batch
        setup = LocalSetup(param_init_fn=param_init_fn, activation_checkpoint_config=nxd_config.activation_checkpoint_config,
                           fp32_grad_accumulation=nxd_config.mixed_precision_config.use_fp32_grad_acc,
                           add_adapters=_adapters(model, nxd_config), record=SetupRecord(input_check=check))
        layer_types = ()
        if pp == 1 and nxd_config.activation_checkpoint_config == "full":
            layer_types = _full_checkpoint_layers(model)
        if tp > 1 and not has_parallel_layers(model) and pp > 1:
            shard_plain_layers(model, nxd_config.dummy_forward_args, tp, _layer_classes(model, pipeline_kwargs))
        elif tp > 1 and not has_parallel_layers(model):
            shard_plain_module(model, nxd_config.dummy_forward_args, tp)
    if pp > 1:
        return NxDPPModel(model, setup=setup, **pipeline_kwargs)
    finish_parallel_model(model, [model], setup, carriers=[model], layer_types=layer_types, hooks_on=model)
    return model


_BUILT_BY_CONFIG_API = ("or build it with nxd_hf.initialize_parallel_model(nxd_hf.neuronx_distributed_config(...), "
                        "model_fn) and pass NxDTrainer that NxDModel")


def check_trainer_model(model: nn.Module, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """``NxDTrainer(model=...)``: a plain module at tp > 1 needs the example inputs its layout is
    traced on (``dummy_forward_args``), and one that is not Hugging Face's (no ``_no_split_modules``)
    at pp > 1 its ``pipeline_config`` (``transformer_layer_cls``, ``input_names``), which
    ``NxDTrainingArguments`` do not carry: the config API's ``NxDModel`` carries both."""
    name = type(model).__name__
    if tensor_parallel_size > 1 and not hasattr(model, "config") and not has_parallel_layers(model):
        raise ValueError(f"{name} is a plain PyTorch module: NxDTrainer shards no plain module over "
                         "tensor_parallel_size > 1. Build its layers from nxd_hf.parallel_layers, use "
                         "tensor_parallel_size=1, " + _BUILT_BY_CONFIG_API + " (neuronx_distributed_config(..., "
                         "dummy_forward_args=...))")
    if pipeline_parallel_size > 1 and not hasattr(model, "config") and not getattr(model, "_no_split_modules", None):
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} for {name}, which names no transformer "
                         "layer class (Hugging Face's _no_split_modules) to cut the pipeline at: NxDTrainingArguments "
                         "carry no pipeline_config; " + _BUILT_BY_CONFIG_API.removeprefix("or ") + " (pipeline_config="
                         "{'transformer_layer_cls': <your layer class>, 'input_names': [...]})")


def _check_options(model: nn.Module, nxd_config) -> None:
    """The options that only mean something for a Hugging Face model nxd_hf shards itself."""
    name = type(model).__name__
    if state_of(model) is not None:
        raise ValueError(f"{name} is already parallelized: model_fn must return the model as built, before "
                         "nxd_hf.parallelize or another initialize_parallel_model")
    if nxd_config.tensor_parallel_size > 1 and not has_parallel_layers(model):
        _check_plain_tp(name, nxd_config)
    elif nxd_config.tensor_parallel_size > 1 and _built_unsharded(model):
        # a model passed built (NxDTrainer's model=) before the groups existed: its layers hold whole
        # weights, which the tp ranks would each use as their shard (the row layers' sums counted tp times)
        raise ValueError(f"{name}'s parallel layers were built at tensor_parallel_size=1 (they hold whole weights), "
                         f"but tensor_parallel_size={nxd_config.tensor_parallel_size}: build the model after "
                         "nxd_hf.neuronx_distributed_config(tensor_parallel_size=...) or "
                         "nxd_hf.parallel_state.initialize_model_parallel(...), or let initialize_parallel_model "
                         "call your model_fn")
    elif nxd_config.dummy_forward_args is not None:
        warnings.warn(f"dummy_forward_args is ignored for {name}: only a plain PyTorch module at "
                      "tensor_parallel_size > 1 is traced on it", stacklevel=4)
    if nxd_config.expert_parallel_size > 1:
        raise ValueError(f"expert_parallel_size > 1 splits the experts of Hugging Face mixture-of-experts layers; "
                         f"{name} is not sharded by nxd_hf: use expert_parallel_size=1")
    if nxd_config.fused_loss:
        raise ValueError(f"fused_loss=True replaces a Hugging Face model's LM head and loss; {name} computes its own "
                         "loss: use fused_loss=False")
    ignored = {"sequence_parallel": (nxd_config.sequence_parallel, "the layers' sequence_parallel_enabled decide it"),
               "pad_model": (nxd_config.pad_model is True, "the model's own layers fix its heads"),
               "kv_size_multiplier": (nxd_config.kv_size_multiplier != "auto",
                                      "GQAQKVColumnParallelLinear's kv_size_multiplier argument decides it")}
    for key, (given, why) in ignored.items():
        if given:
            warnings.warn(f"{key} is ignored for {name}, which nxd_hf does not shard: {why}", stacklevel=4)


def _built_unsharded(model: nn.Module) -> bool:
    sharded = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    return bool(sharded) and all(len(p.shard_index) == p.logical_size for p in sharded)


def _adapters(model: nn.Module, nxd_config):
    """Step 7 (``LocalSetup.add_adapters``): LoRA as for a Hugging Face model, on the layers the
    config's ``target_modules`` name (no model type to default them from)."""
    if nxd_config.lora_config is None:
        return None
    return functools.partial(setup_lora, lora_config=nxd_config.lora_config, model=model,
                             autocast_adapter_dtype=nxd_config.autocast_adapter_dtype)


def _check_plain_tp(name: str, nxd_config) -> None:
    tp = nxd_config.tensor_parallel_size
    if nxd_config.activation_checkpoint_config is not None:
        raise ValueError(
            f"activation_checkpoint_config with {name}, a plain PyTorch module at tensor_parallel_size={tp}: the "
            "module runs as its traced graph (its layouts applied), which calls no layer module to recompute; "
            "build its layers from nxd_hf.parallel_layers, or use activation_checkpoint_config=None or tp=1")


def _layer_classes(model: nn.Module, pipeline_kwargs: dict):
    """``pipeline_config``'s transformer_layer_cls, the layers a plain module's layout is derived in at pp > 1."""
    if pipeline_kwargs.get("transformer_layer_cls") is None:
        return decoder_layer_types(model)  # raises naming transformer_layer_cls when none is found
    return pipeline_kwargs["transformer_layer_cls"]


def _full_checkpoint_layers(model: nn.Module) -> tuple[type, ...]:
    try:
        return decoder_layer_types(model)
    except ValueError:
        raise ValueError(f'activation_checkpoint_config="full" recomputes the transformer layers, which nxd_hf '
                         f"cannot find in {type(model).__name__} (no Hugging Face _no_split_modules): pass the layer "
                         "class instead, activation_checkpoint_config=<YourLayer>") from None
