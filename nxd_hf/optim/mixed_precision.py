"""fp32 master weights for low-precision (bf16/fp16) parameters: ``MasterWeights`` holds fp32
copies that the optimizer steps; after the step they are copied (rounded) back into the
model's parameters. (fp32 gradient accumulation, ``main_grad``, lives with the gradient code in
``nxd_hf.parallel_layers.grads``.)
"""

import torch

from nxd_hf.parallel_layers.grads import accumulated_grad
from nxd_hf.parallel_layers.sharding import copy_tensor_model_parallel_attributes


def is_low_precision(param: torch.Tensor) -> bool:
    return param.dtype in (torch.bfloat16, torch.float16)


class MasterWeights:
    """fp32 masters of a list of parameters (fp32 parameters, and all of them when ``enabled``
    is False, serve as their own master)."""

    def __init__(self, params: list[torch.Tensor], *, enabled: bool = True):
        self.params = params
        self.masters = []
        for param in params:
            if enabled and is_low_precision(param):
                master = param.detach().float().requires_grad_(param.requires_grad)
                copy_tensor_model_parallel_attributes(master, param)
                if hasattr(param, "count_in_grad_norm"):
                    master.count_in_grad_norm = param.count_in_grad_norm
            else:
                master = param
            self.masters.append(master)

    def load_grads(self) -> None:
        """master.grad = the parameter's accumulated gradient, in fp32."""
        for param, master in zip(self.params, self.masters):
            grad = accumulated_grad(param)
            if master is not param:
                master.grad = None if grad is None else grad.float()
            elif grad is not param.grad:  # stepping the low-precision parameter itself
                param.grad = grad.to(param.dtype)

    def store_params(self) -> None:
        """Round the stepped masters back into the parameters."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if master is not param:
                    param.copy_(master)

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.grad = None
            if getattr(param, "main_grad", None) is not None:
                param.main_grad = None
            master.grad = None
