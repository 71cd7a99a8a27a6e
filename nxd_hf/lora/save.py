"""``save_adapter``: PEFT-format files from a model whose adapters came from ``inject_lora``
(no ``PeftModel``), including an ``NxDPPModel`` whose stages live on different ranks."""

import copy
import os

from peft.utils.save_and_load import get_peft_model_state_dict
from safetensors.torch import save_file

from nxd_hf import backend, parallel_state
from nxd_hf.lora import io
from nxd_hf.model_state import state_of

PEFT_PREFIX = "base_model.model."  # what a PeftModel around the HF model puts before every key


def adapter_holders(model) -> list[tuple[str, object]]:
    """(key prefix, module) of every module peft injected into: an ``NxDPPModel``'s stages (their
    parameter names are the HF model's), else the outermost modules of ``model`` holding a
    ``peft_config`` (the model itself, or the pieces given to ``inject_lora``)."""
    state = state_of(model)
    if state is not None and state.pipelined:
        return [("", stage) for stage in state.local_modules]
    holders = []
    for name, module in model.named_modules():
        inside = any(name.startswith(prefix) for prefix, _ in holders if prefix)
        if hasattr(module, "peft_config") and not inside and not (holders and holders[0][0] == ""):
            holders.append((f"{name}." if name else "", module))
    return holders


def _local_logical_state(holders: list, adapter_name: str) -> dict:
    """This rank's adapter tensors under plain peft's keys, gathered over TP."""
    state = {}
    for prefix, module in holders:
        if adapter_name not in module.peft_config:
            continue
        saved = get_peft_model_state_dict(module, state_dict=module.state_dict(keep_vars=True), adapter_name=adapter_name)
        state.update({PEFT_PREFIX + prefix + k: io.logical_tensor(v).contiguous() for k, v in saved.items()})
    return state


def _config_to_write(holders: list, adapter_name: str, hf_model):
    configs = [m.peft_config[adapter_name] for _, m in holders if adapter_name in m.peft_config]
    if not configs:
        raise ValueError(f"no module of this model holds a LoRA adapter named {adapter_name!r}: nothing to save")
    config = copy.copy(configs[0])
    if all(isinstance(c.target_modules, set) for c in configs):  # resolved per piece (e.g. "all-linear")
        config.target_modules = set().union(*(c.target_modules for c in configs))
    # every pipeline stage's resolved targets
    pieces = backend.all_gather_object(config.target_modules, parallel_state.get_pipeline_model_parallel_group())
    if all(isinstance(t, set) for t in pieces):
        config.target_modules = set().union(*pieces)
    config.inference_mode = True  # as peft's save_pretrained writes it
    if config.base_model_name_or_path is None and hf_model is not None:
        config.base_model_name_or_path = getattr(hf_model, "name_or_path", None) or None
    return config


def save_adapter(model, save_directory: str, *, adapter_name: str = "default", config_directory: str | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` as plain peft's
    ``save_pretrained`` does for the unsharded model. ``model``: a parallel HF model into which
    ``inject_lora`` put adapters (whole or piecewise), or an ``NxDPPModel``. Every rank calls it (TP gathers, then the
    PP stages' pieces meet on global rank 0, which writes: tensors first under a temporary name,
    the config last, into ``config_directory`` when given: NxD's ``save_lora_config_adapter=False``)."""
    io.check_every_rank_saves()
    holders = adapter_holders(model)
    state = state_of(model)
    hf_model = state.hf_model if state is not None else model
    state = _local_logical_state(holders, adapter_name)
    config = _config_to_write(holders, adapter_name, hf_model)
    pieces = backend.all_gather_object(state, parallel_state.get_pipeline_model_parallel_group())
    if io.is_writer():
        merged = {k: v for piece in pieces for k, v in piece.items()}
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, "adapter_model.safetensors")
        save_file(dict(sorted(merged.items())), path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
        auto_mapping = None
        if config.task_type is None and hf_model is not None:
            auto_mapping = {"base_model_class": type(hf_model).__name__, "parent_library": type(hf_model).__module__}
        config.save_pretrained(config_directory or save_directory, auto_mapping_dict=auto_mapping)
    io.check_every_rank_saves()
