"""``register_with_peft()``: makes plain peft work on nxd_hf parallel models.

peft builds each LoRA layer in ``LoraModel._create_new_module(lora_config, adapter_name,
target, **kwargs)``, which tries a chain of dispatchers (the per-config, experimental
``LoraConfig._register_custom_module`` mapping first, peft's defaults last) and raises for an
unknown layer. Registering wraps that static method once, process-wide: our dispatcher is tried
first and returns ``LoraColumnParallelLinear`` / ``LoraRowParallelLinear`` for nxd_hf's layers,
anything else falls through to peft's chain unchanged. So ``peft.get_peft_model``,
``inject_adapter_in_model``, ``PeftModel.from_pretrained`` and ``add_adapter`` need no user
step and no per-config registration. ``nxd_hf.parallelize`` calls it.

Also wrapped, each only acting on a model that holds nxd_hf parallel layers:
- ``PeftModel.save_pretrained``: every rank must call it; the adapter tensors are gathered to
  their logical (HF) shapes and global rank 0 writes, so the files are what plain peft writes
  for the unsharded model. A rank calling it alone gets an error after
  ``nxd_hf.lora.io.SAVE_ARRIVAL_TIMEOUT_S`` on gloo, or the process group's timeout otherwise.
- ``peft.peft_model.set_peft_model_state_dict`` (used by ``load_adapter`` / ``from_pretrained``):
  logical tensors are sliced to this rank's shard; a shape that fits neither, and adapter keys
  that did not all load, raise ``ValueError`` (peft only warns).
- ``ModulesToSaveWrapper.update``: the copy of a sharded module keeps its sharding metadata.
- ``tuners_utils._maybe_include_all_linear_layers``: ``target_modules="all-linear"`` also
  takes nxd_hf's parallel linears (peft's rule: every linear but the output layer).

``tests/distributed/lora/test_lora.py::test_peft_dispatch_contract`` fails if these peft internals change.
"""

import functools

from peft import PeftModel, PeftType
from peft import peft_model as peft_model_module
from peft.tuners.lora.model import LoraModel
from peft.tuners import tuners_utils
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from transformers import PreTrainedModel

from nxd_hf.lora import io
from nxd_hf.lora.init_rng import restore_state_for
from nxd_hf.lora.layers import LORA_LAYERS, LoraPartialGradLinear
from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp, is_expert_parallel, is_sharded, parameter_counts


def dispatch_parallel(target, adapter_name: str, config, **kwargs):
    """peft dispatcher for nxd_hf layers, or None (peft's own chain decides)."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    lora_cls = next((cls for base_cls, cls in LORA_LAYERS.items() if isinstance(base, base_cls)), None)
    if kwargs.get("parameter_name") is not None:
        _refuse_sharded_parameter(base, kwargs["parameter_name"])
        return None
    if lora_cls is None:
        return partial_grad_lora(target, base, adapter_name, config, **kwargs)
    # what peft sets (with a warning) for HF's Conv1D vs nn.Linear; it is saved in adapter_config.json
    config.fan_in_fan_out = bool(getattr(base.weight, "hf_transposed", False))
    return lora_cls(target, adapter_name, config=config, **kwargs)


def _refuse_sharded_parameter(base: nn.Module, name: str) -> None:
    """peft's ``target_parameters`` adapter (``lora.ParamWrapper``) is sized from the local tensor: on
    experts split over TP or EP it would be a different, unsynchronized adapter on every rank."""
    param = getattr(base, name, None)
    if param is not None and (is_sharded(param) or is_expert_parallel(param)):
        raise ValueError(
            f"LoRA on the parameter {name!r} of {type(base).__name__} (peft's target_parameters) is not supported "
            "when it is split over tensor or expert parallelism (the mixture-of-experts experts at "
            "tensor_parallel_size > 1 or expert_parallel_size > 1): peft would size the adapter from this rank's "
            "slice. Leave the experts out of target_parameters (LoRA on attention and dense/shared MLPs works at "
            "any size), or use tensor_parallel_size=1 and expert_parallel_size=1")


def partial_grad_lora(target, base, adapter_name: str, config, **kwargs):
    """A ``LoraPartialGradLinear`` for a replicated ``nn.Linear`` with a partial gradient, else None."""
    if type(base) is not nn.Linear or not has_partial_grad_over_tp(base.weight):
        return None
    return LoraPartialGradLinear(target, adapter_name, config=config, **kwargs)


def _wrap_create_new_module(original):
    @functools.wraps(original)
    def create_new_module(lora_config, adapter_name, target, **kwargs):
        restore_state_for(target)  # a pipeline stage's adapter: the draws of plain peft on the whole model
        new_module = dispatch_parallel(target, adapter_name, lora_config, **kwargs)
        return new_module if new_module is not None else original(lora_config, adapter_name, target, **kwargs)

    return create_new_module


def _wrap_save_pretrained(original):
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        if not io.is_parallel_model(self):
            return original(self, save_directory, *args, is_main_process=is_main_process, **kwargs)
        if "state_dict" in kwargs:
            raise ValueError("save_pretrained(state_dict=...) is not supported on an nxd_hf parallel model")
        io.check_every_rank_saves()
        adapters = kwargs.get("selected_adapters") or list(self.peft_config)
        state = self.state_dict(keep_vars=True)
        keep = set()
        for name in adapters:
            keep |= {id(v) for v in peft_model_module.get_peft_model_state_dict(
                self, state_dict=state, adapter_name=name,
                save_embedding_layers=kwargs.get("save_embedding_layers", "auto")).values()}
        kwargs["state_dict"] = io.logical_state_dict(self, keep)
        original(self, save_directory, *args, is_main_process=is_main_process and io.is_writer(), **kwargs)
        io.check_every_rank_saves()  # nobody returns before the files are written

    return save_pretrained


def _wrap_set_state_dict(original):
    @functools.wraps(original)
    def set_peft_model_state_dict(model, peft_model_state_dict, adapter_name="default", **kwargs):
        if not io.is_parallel_model(model):
            return original(model, peft_model_state_dict, adapter_name, **kwargs)
        if kwargs.get("ignore_mismatched_sizes") or kwargs.get("low_cpu_mem_usage"):
            raise ValueError("ignore_mismatched_sizes / low_cpu_mem_usage are not supported on an nxd_hf parallel model")
        handle = model.register_load_state_dict_pre_hook(io.localize_hook)
        try:
            result = original(model, peft_model_state_dict, adapter_name, **kwargs)
        finally:
            handle.remove()
        io.check_all_loaded(result, adapter_name)
        return result

    return set_peft_model_state_dict


def _wrap_include_all_linear(original):
    @functools.wraps(original)
    def include_all_linear(peft_config, model):
        shorthand = isinstance(getattr(peft_config, "target_modules", None), str) and \
            peft_config.target_modules.lower() == "all-linear"
        peft_config = original(peft_config, model)
        if shorthand and io.is_parallel_model(model):  # peft only knows nn.Linear and Conv1D
            output = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
            peft_config.target_modules |= {name for name, module in model.named_modules()
                                           if isinstance(module, tuple(LORA_LAYERS)) and module is not output
                                           and ".base_layer" not in name and ".modules_to_save." not in name}
        return peft_config

    return include_all_linear


def _wrap_modules_to_save_update(original):
    @functools.wraps(original)
    def update(self, adapter_name, **kwargs):
        original(self, adapter_name, **kwargs)
        if adapter_name in self.modules_to_save:
            io.copy_parallel_metadata(self.modules_to_save[adapter_name], self.original_module)

    return update


def refuse_unsharded_methods(peft_config, model) -> None:
    """nxd_hf shards LoRA only: any other peft method on a parallel model (prefix or prompt
    tuning would feed full-size virtual tokens into sharded attention; IA3, LoHa, ... would wrap
    sharded layers as plain ones) is a ValueError on every rank, before peft changes the model."""
    configs = peft_config.values() if isinstance(peft_config, dict) else [peft_config]
    refused = sorted({getattr(getattr(c, "peft_type", None), "value", str(c)) for c in configs
                      if getattr(c, "peft_type", None) != PeftType.LORA})
    if refused and io.is_parallel_model(model):
        others = ", ".join(t.value for t in PeftType if t != PeftType.LORA)
        raise ValueError(
            f"peft method {', '.join(refused)} is not supported on an nxd_hf parallel model: nxd_hf shards only "
            f"LoRA adapters (peft.LoraConfig). Refused: {others}. Use a LoraConfig (lora_config= of "
            "nxd_hf.parallelize, peft_config= of NxDTrainer, or peft.get_peft_model after parallelize), or apply "
            "the method to the unparallelized model")


def _wrap_peft_model_init(original):
    @functools.wraps(original)
    def __init__(self, model, peft_config, *args, **kwargs):
        refuse_unsharded_methods(peft_config, model)
        original(self, model, peft_config, *args, **kwargs)

    return __init__


def _wrap_parameter_counts(original):
    @functools.wraps(original)
    def get_nb_trainable_parameters(self):
        if not io.is_parallel_model(self):
            return original(self)
        return parameter_counts(self.parameters())  # the unparallelized model's, as peft prints them

    return get_nb_trainable_parameters


_PATCHES = (  # (owner, attribute, wrapper, as a staticmethod)
    (PeftModel, "get_nb_trainable_parameters", _wrap_parameter_counts, False),
    (PeftModel, "__init__", _wrap_peft_model_init, False),
    (BaseTuner, "__init__", _wrap_peft_model_init, False),  # inject_adapter_in_model
    (LoraModel, "_create_new_module", _wrap_create_new_module, True),
    (PeftModel, "save_pretrained", _wrap_save_pretrained, False),
    (peft_model_module, "set_peft_model_state_dict", _wrap_set_state_dict, False),
    (ModulesToSaveWrapper, "update", _wrap_modules_to_save_update, False),
    (tuners_utils, "_maybe_include_all_linear_layers", _wrap_include_all_linear, False),
)


def register_with_peft() -> None:
    """Install the wrappers above (idempotent: each is installed at most once per process)."""
    for owner, attribute, wrap, static in _PATCHES:
        current = getattr(owner, attribute)
        if getattr(current, "_nxd_hf", False):
            continue
        wrapped = wrap(current)
        wrapped._nxd_hf = True
        setattr(owner, attribute, staticmethod(wrapped) if static else wrapped)


def is_registered() -> bool:
    return all(getattr(getattr(owner, attribute), "_nxd_hf", False) for owner, attribute, _, _ in _PATCHES)
