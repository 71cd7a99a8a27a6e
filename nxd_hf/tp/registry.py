"""The registry of tensor-parallel patches, by ``config.model_type``.

Patches register themselves here on import; ``nxd_hf.architectures`` imports the bundled ones
(``nxd_hf/model_patches/``), so this module never imports a patch and ``get_patch`` only looks up.
"""

from nxd_hf.tp.derive import patch_from_hf_plan
from nxd_hf.tp.plan import ModelPatch

_PATCHES: dict[str, ModelPatch] = {}


def register_patch(patch: ModelPatch) -> ModelPatch:
    """Register ``patch`` for its ``model_type``; a second registration is an error."""
    if patch.model_type in _PATCHES:
        raise ValueError(f"a tensor-parallel patch for model_type {patch.model_type!r} is already registered")
    _PATCHES[patch.model_type] = patch
    return patch


def registered_model_types() -> list[str]:
    return sorted(_PATCHES)


def get_patch(config) -> ModelPatch:
    """The registered patch for ``config.model_type``, else one derived from the config's
    ``base_model_tp_plan``, else a ValueError listing what is supported."""
    if config.model_type in _PATCHES:
        return _PATCHES[config.model_type]
    hf_plan = getattr(config, "base_model_tp_plan", None)
    if hf_plan:
        return patch_from_hf_plan(config.model_type, hf_plan, config=config)
    raise ValueError(
        f"no tensor-parallel patch for model_type {config.model_type!r} and its config has no "
        f"base_model_tp_plan. Supported: {', '.join(registered_model_types())}. Register one with "
        "nxd_hf.register_patch(nxd_hf.tp.ModelPatch(model_type=..., plan={...}))"
    )
