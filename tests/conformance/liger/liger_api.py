"""Liger-Kernel's fused linear cross-entropy API (``LigerFusedLinearCrossEntropyLoss``, its
functional form and its autograd function, as the vendored test calls them) on nxd_hf's
``fused_linear_cross_entropy``, with the kernel ``conftest.py`` picks. Arguments nxd_hf's loss
does not take skip the case: class weights (``ce_weight``), Liger's z-loss
(``lse_square_scale``, ``return_z_loss``) and ``reduction="none"``."""

import pytest
import torch

from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy

KERNEL = "torch"


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False):
    asked = {"ce_weight": ce_weight is not None, "lse_square_scale": bool(lse_square_scale),
             "return_z_loss": return_z_loss, "reduction='none'": reduction == "none"}
    missing = [name for name, on in asked.items() if on]
    if missing:
        pytest.skip(f"nxd_hf's fused loss has no {', '.join(missing)} (HF's causal-LM loss uses none of them)")
    return fused_linear_cross_entropy(input, weight, target, bias=bias, ignore_index=ignore_index,
                                      label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                                      kernel=KERNEL)


class LigerFusedLinearCrossEntropyFunction:
    @staticmethod
    def apply(input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False):
        return liger_fused_linear_cross_entropy(input, weight, target, bias, ce_weight, ignore_index,
                                                lse_square_scale, label_smoothing, reduction, softcap, return_z_loss)


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False):
        super().__init__()
        self.settings = dict(ce_weight=ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                             label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                             return_z_loss=return_z_loss)

    def forward(self, lin_weight, _input, target, bias=None):
        return liger_fused_linear_cross_entropy(_input, lin_weight, target, bias, **self.settings)
