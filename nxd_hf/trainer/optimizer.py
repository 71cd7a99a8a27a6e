"""``initialize_parallel_optimizer``: an optimizer whose ``step()`` does the data-parallel
gradient reduction (or ZeRO-1's reduce-scatter), gradient clipping on the global norm, and the
step, on fp32 master weights for bf16/fp16 parameters."""

from nxd_hf import backend
from nxd_hf.optim.nxd_optimizer import NxDOptimizer
from nxd_hf.optim.zero1 import NeuronZero1Optimizer
from nxd_hf.parallel_layers.grads import accumulated_grad
from nxd_hf.trainer.config import NxDConfig


def initialize_parallel_optimizer(nxd_config: NxDConfig, optimizer_class, parameters, **defaults):
    """The optimizer for a model from ``initialize_parallel_model`` (see the module docstring)."""
    opt_config, precision = nxd_config.optimizer_config, nxd_config.mixed_precision_config
    max_norm = opt_config.max_grad_norm if opt_config.grad_clipping else None
    if opt_config.zero_one_enabled:  # fp32 masters and the DP reduce-scatter live in ZeRO-1
        if not precision.use_master_weights:
            backend.warn_once("mixed_precision_config use_master_weights=False is ignored with zero_one_enabled: "
                              "ZeRO-1 always steps fp32 master copies of low-precision parameters", stacklevel=2)
        return NeuronZero1Optimizer(parameters, optimizer_class, grad_clipping=opt_config.grad_clipping, max_norm=max_norm,
                                    grad_source=accumulated_grad,
                                    overlap_reduce_scatter=opt_config.overlap_grad_reduce, **defaults)
    return NxDOptimizer(parameters, optimizer_class, max_grad_norm=max_norm,
                        use_master_weights=precision.use_master_weights,
                        reduce_in_backward=opt_config.overlap_grad_reduce or nxd_config.data_parallel_sharding is not None,
                        **defaults)  # under data_parallel_sharding FSDP2's reduce-scatter in backward does the DP mean
