"""Liger Kernel's Triton kernels (RMSNorm, RoPE, SwiGLU) on a parallelized model, on CUDA.

``liger-kernel`` is an optional extra (``pip install 'nxd_hf[liger]'``), imported here only.
Its RMSNorm, rotary and SwiGLU kernels work row by row, so they apply unchanged to nxd_hf's
layers at any tensor-parallel size: the norms are replicated (one sequence chunk each under
sequence parallelism), the rotary embedding sees this rank's heads, and the SwiGLU MLP's
``gate_proj``/``up_proj``/``down_proj`` are the column/row-parallel layers, so the kernel
multiplies this rank's slice of the intermediate activations.

Liger's losses are not used: its (fused linear) cross-entropy assumes the full vocabulary on
every rank, while nxd_hf's logits are vocab-parallel. ``parallelize(..., fused_loss=True)`` is
nxd_hf's equivalent of Liger's fused linear cross-entropy (docs/gpu_speed.md).
"""

import warnings

from torch import nn

from nxd_hf.model_state import state_of

KERNELS = ("rope", "rms_norm", "swiglu")
_LOSSES = ("cross_entropy", "fused_linear_cross_entropy")


def liger_options(kernel_config: dict | None) -> dict[str, bool]:
    """Liger's keyword arguments for ``kernel_config`` (transformers' ``liger_kernel_config``):
    the kernels as asked (all by default), its losses always off, with a warning when asked."""
    kernel_config = dict(kernel_config or {})
    unknown = sorted(set(kernel_config) - set(KERNELS) - set(_LOSSES))
    if unknown:
        raise ValueError(f"liger_kernel_config keys {unknown} are not Liger options nxd_hf applies; "
                         f"use {list(KERNELS + _LOSSES)}")
    if any(kernel_config.get(loss) for loss in _LOSSES):
        warnings.warn("Liger's cross-entropy kernels assume the full vocabulary on every rank; nxd_hf's logits are "
                      "vocab-parallel, so its own loss is kept (parallelize(..., fused_loss=True), "
                      "NxDTrainingArguments(fused_loss=True) is the fused-linear equivalent)", stacklevel=3)
    options = {kernel: bool(kernel_config.get(kernel, True)) for kernel in KERNELS}
    return {**options, **dict.fromkeys(_LOSSES, False)}


def apply_liger_kernels(model: nn.Module, kernel_config: dict | None = None) -> None:
    """Patch the parallelized (``nxd_hf.parallelize``) HF ``model`` on a CUDA device with Liger's
    RMSNorm, RoPE and SwiGLU kernels (``kernel_config`` may turn each off: ``{"rope": False}``)."""
    state = state_of(model)
    if state is None:
        raise ValueError("apply_liger_kernels takes a model returned by nxd_hf.parallelize (or its peft model)")
    if state.pp_size > 1:
        raise ValueError("Liger kernels are not supported with pipeline_parallel_size > 1 (the stages run a traced "
                         "graph that does not call the patched module forwards): use pipeline_parallel_size=1")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise ValueError(f"Liger's kernels are Triton kernels for CUDA GPUs; this model is on {sorted(devices)}. "
                         "Drop use_liger_kernel (or apply_liger_kernels) on CPU and XLA")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as error:
        raise ValueError(f"Liger kernels need the liger-kernel package ({error}): pip install 'nxd_hf[liger]'") from None
    options = liger_options(kernel_config)
    hf_model = state.hf_model
    patched_before = _liger_modules(hf_model)
    _apply_liger_kernel_to_instance(model=hf_model, **options)
    if _liger_modules(hf_model) == patched_before and any(options[k] for k in ("rms_norm", "swiglu")):
        warnings.warn(f"liger-kernel has no kernels for model_type {hf_model.config.model_type!r}: nothing was "
                      "patched", stacklevel=2)


def _liger_modules(model: nn.Module) -> int:
    """How many modules Liger has patched (it renames them ``Liger*`` through ``_get_name``)."""
    return sum(module._get_name().startswith("Liger") for module in model.modules())
