"""NxD's LoRA checkpoint modes: what ``nxd_hf.checkpoint.save_checkpoint`` writes of a model
with LoRA adapters, and what ``load_checkpoint`` and ``LoraConfig(load_lora_from_ckpt=True)``
read back.

``setup_lora`` (``nxd_hf.lora.setup``, the LoRA slot of ``nxd_hf.parallelize``'s setup sequence)
records a ``LoraCheckpoint`` in the model's state, ``model.nxd.adapters``; the checkpoint package
calls it through its ``Adapters`` protocol (``nxd_hf.checkpoint.logical``), never importing
``lora/``. A checkpoint ``path/tag`` of a LoRA model holds:

- ``adapter/``: the adapter in PEFT format (``adapter_model.safetensors`` +
  ``adapter_config.json``), for ``PeftModel.from_pretrained(base_model, "path/tag/adapter")``.
  With ``save_lora_config_adapter=False`` the config goes to ``lora_adapter/adapter_config.json``
  instead (NxD's name) and ``adapter/`` holds the tensors only;
- the index's "adapter" section: the same tensors in logical coordinates under the model's
  parameter names, with their optimizer state (resuming at any parallel sizes);
- with ``save_lora_base=True``, the "model" section: the base model under the names
  ``save_pretrained`` writes, which ``nxd_hf.consolidate`` turns into a plain HF model; with
  ``merge_lora=True`` too, each adapted weight is saved as ``W + s B A`` (computed for the saved
  copy: the model and its training state are unchanged). NxD saves no adapter in that mode; we
  keep it, so the merged checkpoint still resumes training.

Loading (``load_checkpoint`` on a LoRA model, or ``load_lora_from_ckpt``) reads the adapter
section and an unmerged base; a merged base is not read (the adapters would apply twice), the
model keeps the base it was built with. ``load_lora_from_ckpt`` takes the LoRA settings (rank,
alpha, targets, ...) from the saved ``adapter_config.json``, as NxD does.
"""

import dataclasses
import os

from peft.tuners.lora.layer import LoraLayer
from peft.utils.save_and_load import get_peft_model_state_dict

from nxd_hf.checkpoint.logical import hf_model, local_roots, logical_tensors, named_local_tensors
from nxd_hf.lora.save import adapter_holders, save_adapter
from nxd_hf.modules.lora import LoraConfig as NxDLoraConfig

ADAPTER_DIR = "adapter"
SEPARATE_CONFIG_DIR = "lora_adapter"


class LoraCheckpoint:
    """The ``Adapters`` protocol of ``nxd_hf.checkpoint.logical`` for LoRA adapters.
    ``lora_config``: NxD's ``LoraConfig`` the model was built with (its save modes), or None
    (built from a ``peft.LoraConfig``: the adapter alone is saved unless ``nxd_config`` says)."""

    def __init__(self, lora_config: NxDLoraConfig | None, adapter_name: str = "default"):
        self.lora_config, self.adapter_name = lora_config, adapter_name

    def save_plan(self, nxd_config) -> dict:
        """What to save, from ``nxd_config.lora_config`` when it is NxD's, else the model's."""
        config = getattr(nxd_config, "lora_config", None)
        config = config if isinstance(config, NxDLoraConfig) else self.lora_config
        base = "none"
        if config is not None and config.save_lora_base:
            base = "merged" if config.merge_lora else "separate"
        separate_config = config is not None and not config.save_lora_config_adapter
        return {"base": base, "adapter_dir": ADAPTER_DIR, "adapter_name": self.adapter_name,
                "config_dir": SEPARATE_CONFIG_DIR if separate_config else ADAPTER_DIR}

    def logical_tensors(self, model, plan: dict | None, *, loading: bool) -> list:
        return self.tensors_of(local_roots(model), hf_model(model), plan, loading=loading)

    def tensors_of(self, roots: list, hf, plan: dict | None, *, loading: bool) -> list:
        """``LogicalTensor``s of ``roots``' tensors: the adapters' (section "adapter") and the base
        model's as ``plan`` says. ``plan`` None (loading a checkpoint saved without adapters):
        its tensors are the base model's."""
        base = "separate" if plan is None else plan["base"]
        read_base = base == "separate" or (base == "merged" and not loading)
        adapter_ids = self._adapter_tensor_ids(roots)
        adapters, bases = [], []
        for name, tensor in named_local_tensors(roots):
            if id(tensor) in adapter_ids:
                adapters.append((name, tensor))
            base_name = peft_base_name(name, merged=base == "merged")
            if read_base and base_name is not None:
                bases.append((base_name, tensor))
        merged = _merged_weights(roots, self.adapter_name) if base == "merged" and not loading else {}
        out = [dataclasses.replace(lt, section="adapter") for lt in logical_tensors(hf, named=adapters)]
        out += [dataclasses.replace(lt, tensor=merged.get(id(lt.tensor), lt.tensor))
                for lt in logical_tensors(hf, named=bases)]
        return out

    def _adapter_tensor_ids(self, roots: list) -> set[int]:
        """What peft saves of the adapter (LoRA A/B, modules_to_save copies, trained biases),
        and whatever else trains (it has optimizer state)."""
        ids = set()
        for root in roots:
            for _, holder in adapter_holders(root):
                if self.adapter_name in holder.peft_config:
                    state = holder.state_dict(keep_vars=True)
                    saved = get_peft_model_state_dict(holder, state_dict=state, adapter_name=self.adapter_name)
                    ids |= {id(v) for v in saved.values()}
            ids |= {id(p) for p in root.parameters() if p.requires_grad}
        return ids

    def write_files(self, model, directory: str, plan: dict) -> None:
        """The PEFT-format adapter (every rank calls it; global rank 0 writes)."""
        save_adapter(model, os.path.join(directory, plan["adapter_dir"]), adapter_name=plan["adapter_name"],
                     config_directory=os.path.join(directory, plan["config_dir"]))


def peft_base_name(name: str, *, merged: bool) -> str | None:
    """The HF name of a base-model tensor (peft's wrapping undone), None for an adapter tensor.
    ``modules_to_save``: the trained copy in a merged base (as ``merge_and_unload``), else the original."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return None
    if "modules_to_save" in parts:
        if not merged:
            return None
        i = parts.index("modules_to_save")
        parts = parts[:i] + parts[i + 2 :]  # drops "modules_to_save.<adapter>"
    elif "original_module" in parts and merged:
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def _merged_weights(roots: list, adapter_name: str) -> dict:
    """id(base weight) -> this rank's ``W + s B A`` for every LoRA layer (local shards: B or A is
    sharded like the weight, so peft's ``get_delta_weight`` gives this rank's rows/columns)."""
    merged = {}
    for root in roots:
        for name, module in root.named_modules():
            if not isinstance(module, LoraLayer) or adapter_name not in module.lora_A:
                continue
            if module.merged:
                raise ValueError(f"{name} has its adapters merged into its weight: call unmerge_adapter() before "
                                 "save_checkpoint (it saves the base and the adapters as LoraConfig says)")
            weight = module.get_base_layer().weight
            merged[id(weight)] = weight.detach() + module.get_delta_weight(adapter_name).to(weight.dtype)
    return merged
