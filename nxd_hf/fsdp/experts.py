"""Expert parameters under ZeRO-2/3 with expert parallelism (``nxd_hf.fsdp``).

Each expert-parallel rank holds other experts (``nxd_hf.moe.ep_dispatch``): the ranks holding
the same experts are the expert-data group, not the data-parallel group. So every module whose
own parameters are expert-parallel (HF's fused experts) is its own FSDP group, sharded over a
mesh of the expert-data group; the rest of its layer is sharded over the DP group as usual.

Its gradient is a data-parallel mean all the same: the all-to-all's backward already summed the
tokens of its expert-parallel peers, so the expert-data ranks' gradients are summed and divided
by the DP size (``grads.data_parallel_mean``), not by the expert-data size, FSDP2's default. FSDP2
sums (gloo has no pre-multiplied sum) and a hook on its reduced shard divides by the DP size: a
divide factor would be applied twice where the expert-data group is one rank (pp=2 x ep=2 at
world 4, or an HSDP shard group of one), as FSDP2's copy for one rank divides by it and then
divides again after the "reduction".

A rank whose experts got no token (HF's eager experts loop) has no gradient for them, and FSDP2
would then reduce-scatter fewer gradients there than on its peers: their zeros are reduce-scattered
instead (``set_reduce_scatter_unused_params``, DDP's ``find_unused_parameters``).
"""

from torch import nn

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import is_expert_parallel


def expert_modules(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` whose own parameters are expert-parallel (all of them, or a ValueError)."""
    found = []
    for name, module in root.named_modules():
        own = list(module.parameters(recurse=False))
        experts = [p for p in own if is_expert_parallel(p)]
        if experts and len(experts) != len(own):
            raise ValueError(f"data_parallel_sharding with expert parallelism: {name!r} holds both expert-parallel and "
                             "other parameters, which FSDP2 cannot shard over different groups: use "
                             "data_parallel_sharding=None")
        if experts:
            found.append(module)
    return found


def shard_experts(module: nn.Module, mesh, *, reshard_after_forward: bool, **fsdp_kwargs) -> None:
    """``fully_shard`` one experts module over ``mesh`` (the expert-data group), its gradient a DP mean."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    module.set_gradient_divide_factor(1.0)  # a sum over the mesh (module docstring) ...
    module.set_force_sum_reduction_for_comms(True)
    dp = float(parallel_state.get_data_parallel_size())
    module.set_all_reduce_hook(lambda reduced: reduced.div_(dp))  # ... then the DP mean, on the shard
    module.set_reduce_scatter_unused_params(True, recurse=False)

