"""``setup_lora``: step 7 of ``nxd_hf.parallelize``'s setup sequence (the LoRA slot of
``nxd_hf.model_setup.LocalSetup``): LoRA adapters injected into this rank's modules, NxD's
``LoraConfig(load_lora_from_ckpt=True)`` read back, and the adapters' checkpoint protocol
(``nxd_hf.lora.checkpoint.LoraCheckpoint``), which the model's state records as ``model.nxd.adapters``.
"""

import contextlib
import os
import warnings

import peft
import torch
import transformers

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.load import load_model_tensors, read_index
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.lora.checkpoint import LoraCheckpoint
from nxd_hf.lora.inject import print_trainable, inject_lora
from nxd_hf.lora.meta_base import AdapterRedraw, has_meta_parameters, real_stand_ins
from nxd_hf.model_setup.local import target_device
from nxd_hf.modules.lora import LoraConfig as NxDLoraConfig


def setup_lora(modules: list, *, lora_config, model, autocast_adapter_dtype: bool = True,
               device=None, redraw: AdapterRedraw | None = None) -> LoraCheckpoint | None:
    """Step 7 of ``nxd_hf.parallelize``: LoRA adapters on ``modules`` (``inject_lora``); with
    NxD's ``load_lora_from_ckpt``, the LoRA settings saved with the checkpoint's adapter, then its
    adapter (and unmerged base) tensors. Returns the ``LoraCheckpoint`` (``model.nxd.adapters``
    once the model is finished), None when NxD's config disables LoRA. A base still on the meta
    device (ZeRO-2/3, filled once sharded) stays there: the adapters are made on ``device`` (the
    setup's, ``target_device``) as on a real base (``nxd_hf.lora.meta_base``). ``redraw``: the base
    is initialized later (``param_init_fn`` into the DP shards): the generator is put back as it
    was, the adapters are drawn again after that init (``meta_base.redraw_adapters``) as ``redraw``
    records (filled here)."""
    nxd_config = lora_config if isinstance(lora_config, NxDLoraConfig) else None
    if nxd_config is not None and not nxd_config.enable_lora:
        inject_lora(modules, nxd_config)  # warns that nothing is added
        return None
    plan = None
    # no collectives until the adapters are in: a rank failing here alone fails every rank
    with fail_together("nxd_hf.parallelize (step 7: LoRA adapters)"):
        if nxd_config is not None and nxd_config.load_lora_from_ckpt:
            directory, index = read_index(nxd_config.lora_save_dir, nxd_config.lora_load_tag)
            plan = index.get("adapters")
            if plan is None:
                raise ValueError(f"LoraConfig.load_lora_from_ckpt: checkpoint {directory} holds no LoRA adapter (it "
                                 "was saved from a model without LoRA): point lora_save_dir/lora_load_tag at a LoRA "
                                 "checkpoint")
            lora_config = _saved_config(os.path.join(directory, plan["config_dir"]), nxd_config)
        model_type = model.config.model_type if isinstance(model, transformers.PreTrainedModel) else None
        on_meta, rng_state = has_meta_parameters(modules), torch.get_rng_state()
        if redraw is not None:
            redraw.base_modules = {id(m) for root in modules for m in root.modules()}
        with real_stand_ins(modules, target_device(device, modules)) if on_meta else contextlib.nullcontext():
            inject_lora(modules, lora_config, adapter_name="default", model_type=model_type,
                        autocast_adapter_dtype=autocast_adapter_dtype, hf_model=model, redraw=redraw)
        if redraw is not None:
            torch.set_rng_state(rng_state)
    _same_adapters_on_every_replica(modules)
    checkpoint = LoraCheckpoint(nxd_config)
    if plan is None:
        return checkpoint
    if plan["base"] == "merged":
        warnings.warn("load_lora_from_ckpt: the checkpoint's base has the adapter merged in; only the adapter is "
                      "loaded, the base stays as the model was built (the original base weights)")
    lts = checkpoint.tensors_of(list(modules), model, plan, loading=True)
    load_model_tensors(nxd_config.lora_save_dir, nxd_config.lora_load_tag, model, lts)
    if nxd_config.lora_verbose:
        print_trainable(list(modules))
    return checkpoint


def _same_adapters_on_every_replica(modules: list) -> None:
    """The adapters start as data-parallel rank 0 made them. peft draws them from the global RNG,
    whose state the ranks of a DP group need not share (user code before setup may consume it
    differently): unsynchronized, DP replicas would train different adapters. One broadcast per
    trainable tensor over the DP group (adapters are small)."""
    group = parallel_state.get_data_parallel_group()
    if backend.group_size(group) == 1:
        return
    src = backend.global_rank(group, 0)
    with torch.no_grad():
        for module in modules:
            for param in module.parameters():
                if param.requires_grad and not param.is_meta:  # a meta base's biases are filled once sharded
                    backend.broadcast(param.data, src, group)


_SAVED_FIELDS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "bias": "bias",
                 "use_rslora": "use_rslora", "target_modules": "target_modules", "modules_to_save": "modules_to_save"}


def _saved_config(config_dir: str, nxd_config: NxDLoraConfig) -> peft.LoraConfig:
    """The checkpoint's LoRA settings, trainable; a warning names the fields of ``nxd_config`` set
    to other values (they are ignored)."""
    if not os.path.isfile(os.path.join(config_dir, "adapter_config.json")):
        raise ValueError(f"load_lora_from_ckpt: {config_dir}/adapter_config.json is missing: the checkpoint is "
                         "incomplete or was not written by nxd_hf.save_checkpoint")
    config = peft.LoraConfig.from_pretrained(config_dir)
    config.inference_mode = False
    defaults = NxDLoraConfig()
    ignored = []
    for ours, theirs in _SAVED_FIELDS.items():
        value, saved = getattr(nxd_config, ours), getattr(config, theirs)
        if isinstance(value, (list, set)) and isinstance(saved, (list, set)):
            value, saved = set(value), set(saved)
        if getattr(defaults, ours) != getattr(nxd_config, ours) and value != saved:
            ignored.append(f"{ours}={getattr(nxd_config, ours)!r} (saved: {saved!r})")
    if ignored:
        warnings.warn(f"LoraConfig: {', '.join(ignored)} ignored: load_lora_from_ckpt uses the LoRA settings saved "
                      f"with the adapter ({config_dir})")
    return config
