"""Mixed precision for low-precision (bf16/fp16) parameters: fp32 gradient accumulation and
fp32 master weights.

- ``install_fp32_grad_accumulation``: after each backward, a parameter's low-precision
  gradient is added into an fp32 ``param.main_grad`` and ``param.grad`` is released, so
  accumulation over micro-steps happens in fp32 (Megatron's main_grad).
- ``MasterWeights``: fp32 copies of the parameters that the optimizer steps; after the step
  they are copied (rounded) back into the model's parameters.
"""

import torch

from nxd_hf.parallel_layers.sharding import copy_tensor_model_parallel_attributes


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's accumulated gradient: the fp32 ``main_grad`` under fp32 accumulation."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def is_low_precision(param: torch.Tensor) -> bool:
    return param.dtype in (torch.bfloat16, torch.float16)


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    if param.main_grad is None:
        param.main_grad = param.grad.float()
    else:
        param.main_grad.add_(param.grad)
    param.grad = None


def install_fp32_grad_accumulation(params) -> int:
    """Accumulate the gradients of the low-precision ``params`` in fp32; returns how many."""
    count = 0
    for param in params:
        if is_low_precision(param) and param.requires_grad and not hasattr(param, "main_grad"):
            param.main_grad = None
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            count += 1
    return count


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
