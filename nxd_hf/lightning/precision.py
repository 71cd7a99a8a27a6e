"""``NeuronXLAPrecisionPlugin``: bf16 autocast around training and evaluation steps. bf16
parameters with fp32 master weights are nxd_hf's mixed precision instead: build the model in bf16
(``model_fn``) and keep ``mixed_precision_config``'s defaults (docs/lightning.md)."""

import contextlib

import torch

from nxd_hf import backend
from nxd_hf.lightning.flavor import Precision


class NeuronXLAPrecisionPlugin(Precision):
    def __init__(self, precision: str = "bf16-mixed"):
        if precision not in ("bf16-mixed", "32-true"):
            raise ValueError(f"NeuronXLAPrecisionPlugin: precision {precision!r} is not supported: use 'bf16-mixed' "
                             "(autocast) or '32-true'; for bf16 parameters build the model in bf16 (model_fn)")
        self.precision = precision

    def forward_context(self):
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return torch.autocast(backend.default_device().type, dtype=torch.bfloat16)
