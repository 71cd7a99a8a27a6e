"""torch's ``GradScaler`` on a parallelized model: every rank skips a step together.

``GradScaler.unscale_`` looks for inf/nan in this rank's gradients only. On a parallel model a
gradient that overflows in one rank's shard (the first overflow after the scale grew is a
single element, on one rank) makes that rank skip the step and halve its scale while the other
TP ranks step: their replicated weights and their scales part, silently. So importing nxd_hf
wraps ``GradScaler._unscale_grads_`` (``install``): for an optimizer holding parameters of a
model nxd_hf set up (``torch_clip.in_parallel_model``), the inf flags are maxed over every rank,
as FSDP's ``ShardedGradScaler`` does over its group, before the step is taken or skipped; for any
other optimizer it is torch's own. ``torch.cuda.amp.GradScaler`` is a subclass: covered.
"""

import functools

import torch
from torch.amp import grad_scaler

from nxd_hf import backend
from nxd_hf.parallel_layers.torch_clip import in_parallel_model


def _unscale_grads_(torch_unscale_grads_):
    @functools.wraps(torch_unscale_grads_)
    def unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found_inf_per_device = torch_unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16)
        if any(in_parallel_model(p) for group in optimizer.param_groups for p in group["params"]):
            # one all-reduce on every rank, however many devices its gradients are on (none included)
            flags = [flag.to(found_inf.device) for flag in found_inf_per_device.values()]
            anywhere = torch.stack(flags).amax() if flags else torch.zeros_like(found_inf)
            backend.all_reduce(anywhere, None, op="max")
            for flag in found_inf_per_device.values():
                flag.copy_(anywhere)
        return found_inf_per_device

    unscale_grads_.nxd_hf_routes_parallel_models = True
    return unscale_grads_


def install() -> None:
    """Wrap ``torch.amp.GradScaler._unscale_grads_`` once; a second call changes nothing."""
    scaler = grad_scaler.GradScaler
    if not getattr(scaler._unscale_grads_, "nxd_hf_routes_parallel_models", False):
        scaler._unscale_grads_ = _unscale_grads_(scaler._unscale_grads_)
