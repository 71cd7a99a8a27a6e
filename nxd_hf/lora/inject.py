"""``inject_lora``: LoRA adapters on a parallelized model or on its pipeline stage modules,
through peft's ``inject_adapter_in_model`` (the setup sequence's LoRA slot), and the
conversion of NxD's ``LoraConfig`` (``nxd_hf.modules.lora``) to ``peft.LoraConfig``."""

import contextlib
import copy
import warnings

import peft
from peft.tuners import tuners_utils
from peft.tuners.tuners_utils import cast_adapter_dtype, check_target_module_exists
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from peft.utils.other import _set_trainable
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.lora.dispatch import register_with_peft
from nxd_hf.lora.init_rng import drawn_as_whole_model
from nxd_hf.lora.layers import check_supported_init
from nxd_hf.modules.lora import LoraConfig as NxDLoraConfig
from nxd_hf.parallel_layers.sharding import parameter_counts


def to_peft_config(config: NxDLoraConfig) -> peft.LoraConfig:
    """The ``peft.LoraConfig`` of NxD's LoRA fields (the checkpoint fields stay with ``config``)."""
    return peft.LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, bias=config.bias,
        target_modules=config.target_modules, modules_to_save=config.modules_to_save,
        use_rslora=config.use_rslora, init_lora_weights=True if config.init_lora_weights == "default" else "gaussian",
    )


def _resolve_targets(config: peft.LoraConfig, model_type: str | None) -> peft.LoraConfig:
    if config.target_modules is not None or config.target_parameters:
        return config
    if model_type is None:
        raise ValueError("LoRA on a model that is not a Hugging Face model (no config.model_type to take peft's "
                         "default target_modules from): set target_modules to the names of its layers to adapt")
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if targets is None:
        raise ValueError(
            f"peft has no default LoRA target_modules for model_type {model_type!r}: set target_modules explicitly"
        )
    config = peft.LoraConfig(**{**config.to_dict(), "target_modules": set(targets)})
    return config


# peft's task models train their heads too: get_peft_model with this task_type adds these names to
# modules_to_save (PeftModelForSequenceClassification, ...ForTokenClassification, ...ForQuestionAnswering)
TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"), "QUESTION_ANS": ("qa_outputs",)}


def _with_task_heads(config: peft.LoraConfig) -> peft.LoraConfig:
    """``config`` with its task type's heads in ``modules_to_save``, as peft's task model adds them
    (a copy: the caller's config is left alone)."""
    heads = TASK_HEADS.get(getattr(config.task_type, "value", config.task_type), ())
    to_save = list(config.modules_to_save or [])
    missing = [head for head in heads if head not in to_save]
    if not missing:
        return config
    config = copy.copy(config)
    config.modules_to_save = to_save + missing
    return config


def _module_config(module: nn.Module, config: peft.LoraConfig, output_layer: str) -> peft.LoraConfig:
    """``config`` for one module; "all-linear" is resolved here by peft's rule (every linear
    layer, nxd_hf's included, but the output layer, which peft finds only on a whole HF model)."""
    if not (isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"):
        return config
    resolved = tuners_utils._maybe_include_all_linear_layers(copy.deepcopy(config), module)  # registered wrapper
    resolved.target_modules = {n for n in resolved.target_modules if n.rsplit(".", 1)[-1] != output_layer}
    return resolved


def _matching(module: nn.Module, config: peft.LoraConfig) -> list[str]:
    """The modules ``config`` targets in ``module``, and the parameters (``target_parameters``:
    peft's rule, the parameter's dotted name or a ``.name`` suffix of it)."""
    names = [name for name, _ in module.named_modules() if name and check_target_module_exists(config, name)]
    targets = list(config.target_parameters or [])
    if targets:
        names += [name for name, _ in module.named_parameters()
                  if any(name == t or name.endswith("." + t) for t in targets)]
    return names


def _converted_for_transformers(config: peft.LoraConfig, hf_model: nn.Module) -> peft.LoraConfig:
    """``config`` as peft rewrites it when it injects into the whole ``hf_model``: for the MoE
    models transformers 5 re-laid out, the per-expert names of transformers 4 (``w1``,
    ``gate_proj``, ...) target the fused experts (``target_parameters``) instead of any module of
    that name. Pipeline stages carry no HF config, so peft would not do it there."""
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers, get_model_conversion_mapping,
        )
    except ImportError:  # a peft without the transformers-5 conversion
        return config
    config = copy.deepcopy(config)
    convert_peft_config_for_transformers(config, model=hf_model, conversions=get_model_conversion_mapping(hf_model))
    return config


def inject_lora(model, lora_config, *, adapter_name: str = "default", model_type: str | None = None,
                output_layer: str = "lm_head", autocast_adapter_dtype: bool = True, hf_model: nn.Module | None = None,
                redraw=None):
    """Add LoRA adapters in place to ``model``: a parallelized HF model, or a list of pipeline
    stage modules (each gets the adapters of the layers it holds). ``lora_config`` is a
    ``peft.LoraConfig`` or NxD's ``LoraConfig``; ``target_modules`` follow peft's matching rules
    and default to peft's table for ``model_type`` (default: ``model.config.model_type``);
    "all-linear" skips the layer named ``output_layer`` (as peft skips the output embeddings).
    Only the adapters (and biases when ``bias`` asks) require grad afterwards. As
    ``peft.get_peft_model``, adapters on a bf16/fp16 base are kept in fp32 unless
    ``autocast_adapter_dtype=False`` (then they take the base layer's dtype). ``hf_model``: the
    HF model the stage modules come from, whose config peft adapts to it (MoE names,
    ``_converted_for_transformers``) as ``get_peft_model`` does on the whole model. ``redraw``: an
    ``nxd_hf.lora.meta_base.AdapterRedraw`` given the whole model's targets (pipeline stages). Returns ``model``."""
    if isinstance(lora_config, NxDLoraConfig):
        if not lora_config.enable_lora:
            warnings.warn("LoraConfig.enable_lora is False: no LoRA adapters are added")
            return model
        verbose, lora_config = lora_config.lora_verbose, to_peft_config(lora_config)
    else:
        verbose = False
    if not isinstance(lora_config, peft.LoraConfig):
        raise ValueError(f"lora_config must be a peft.LoraConfig or nxd_hf.modules.lora.LoraConfig, got {type(lora_config)}")
    check_supported_init(lora_config)
    register_with_peft()
    modules = list(model) if isinstance(model, (list, tuple)) else [model]
    if model_type is None:
        model_type = getattr(getattr(modules[0], "config", None), "model_type", None)
    lora_config = _with_task_heads(_resolve_targets(lora_config, model_type))
    if getattr(hf_model, "config", None) is not None and not any(m is hf_model for m in modules):
        lora_config = _converted_for_transformers(lora_config, hf_model)
    configs = [_module_config(m, lora_config, output_layer) for m in modules]
    matches = [_matching(m, c) for m, c in zip(modules, configs)]
    if not any(matches) and hf_model is not None and _matching(hf_model, lora_config):
        # frozen, a stage's output would carry no gradient and its peer would wait for one
        raise ValueError(
            f"LoRA target_modules {lora_config.target_modules!r} match modules only on other pipeline stages: at "
            "pipeline_parallel_size > 1 every stage needs at least one adapter; target modules in every stage's "
            "layers (e.g. a projection name every layer has), or use pipeline_parallel_size=1")
    if not any(matches):
        raise ValueError(
            f"LoRA target_modules {lora_config.target_modules!r} match no module of the model (peft's rules: a name "
            "matches a module named so or ending in '.name'; a string is a full-match regex)"
        )
    with _stage_draws(lora_config, modules, hf_model, output_layer, redraw):
        for module, config, matched in zip(modules, configs, matches):
            if matched:
                peft.inject_adapter_in_model(config, module, adapter_name=adapter_name)
                cast_adapter_dtype(module, adapter_name=adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
            else:
                _freeze_stage_without_targets(module, config, adapter_name)
    if verbose:
        print_trainable(modules)
    return model


def _stage_draws(config: peft.LoraConfig, modules: list, hf_model: nn.Module | None, output_layer: str, redraw):
    """Pipeline stages of ``hf_model``: their adapters drawn as plain peft draws them on the whole
    model (``nxd_hf.lora.init_rng``); the whole model, or stages without ``hf_model``: as they come."""
    if hf_model is None or any(m is hf_model for m in modules):
        return contextlib.nullcontext()
    if config.target_parameters:
        warnings.warn("LoRA target_parameters on pipeline stages: the adapters are initialized from this stage's "
                      "generator state, not as plain peft on the whole model; load a saved adapter (or copy the "
                      "plain model's) for the same initial adapters")
        return contextlib.nullcontext()
    whole = _module_config(hf_model, config, output_layer)
    names = dict(hf_model.named_modules())
    targets = [name for name in _matching(hf_model, whole) if name in names]
    if redraw is not None:
        redraw.whole_model = (whole, hf_model, targets)
    return drawn_as_whole_model(whole, hf_model, targets, modules)


def _freeze_stage_without_targets(module: nn.Module, config: peft.LoraConfig, adapter_name: str) -> None:
    """What peft's injection does to a model's modules outside the targets, for a stage that
    holds none (peft refuses to inject there): freeze, except biases with bias="all" and
    ``modules_to_save``."""
    for name, param in module.named_parameters():
        param.requires_grad_(config.bias == "all" and name.endswith("bias"))
    if config.modules_to_save:
        _set_trainable(module, adapter_name, config.modules_to_save, inference_mode=config.inference_mode)
    module.peft_config = {adapter_name: config}  # as injection leaves it: save_adapter reads it


def print_trainable(modules: list[nn.Module]) -> None:
    """peft's line, with the unparallelized model's counts (of this rank's pipeline stages at pp > 1)."""
    trainable, total = parameter_counts(p for m in modules for p in m.parameters())
    where = " (this rank's pipeline stages)" if parallel_state.get_pipeline_model_parallel_size() > 1 else ""
    print(f"LoRA: trainable params{where}: {trainable:,} || all params: {total:,} || "
          f"trainable%: {100 * trainable / max(total, 1):.4f}")
