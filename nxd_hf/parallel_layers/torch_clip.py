"""``torch.nn.utils.clip_grad_norm_`` on a parallelized model's parameters: the whole model's norm.

On a rank of a tensor-, pipeline- or expert-parallel model, torch's ``clip_grad_norm_`` sees only
this rank's shards. Its norm then differs between the ranks of a TP group, each scales its
gradients by a different coefficient, and the parameters every TP rank holds whole drift apart,
silently. So importing nxd_hf wraps it (``install``): given any parameter of a model nxd_hf set up
(``in_parallel_model``, set by ``nxd_hf.model_setup.finish_parallel_model`` and carried wherever the
sharding metadata goes), or one sharded over TP or split over experts, it is
``nxd_hf.parallel_layers.clip_grad_norm`` (the norm of the unsharded model; every rank of the
model-parallel group calls it, as for any collective); given anything else, torch's own, unchanged.

Callers that look the function up when they call it get the wrapper: a user's loop, the
deprecated ``clip_grad_norm``, Lightning's precision plugins. Not covered: a name bound before
``import nxd_hf`` (``from torch.nn.utils import clip_grad_norm_`` above it; call
``nxd_hf.parallel_layers.clip_grad_norm`` there), and ``torch.nn.utils.get_total_norm``, which
takes gradients without their parameters (accelerate's ``Accelerator.clip_grad_norm_`` uses it:
train a parallelized model with ``NxDTrainer``, whose clipping is the whole model's).

NxD leaves torch's function alone, and its users call ``parallel_layers.clip_grad_norm``; routing
torch's is a deliberate difference: the same call on the unparallelized model and on its parallel
version gives the same norm and the same clipped step.
"""

import functools
import types

import torch
from torch.nn.utils import clip_grad as torch_clip_grad

from nxd_hf.parallel_layers.grads import clip_grad_norm
from nxd_hf.parallel_layers.sharding import is_expert_parallel, is_sharded


def mark_parallel_model(params) -> None:
    """Mark ``params`` as parameters of a model nxd_hf set up (their norm is the whole model's)."""
    for param in params:
        param.in_parallel_model = True


def in_parallel_model(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a model nxd_hf set up (or is a sharded or expert-parallel tensor)."""
    return getattr(param, "in_parallel_model", False) or is_sharded(param) or is_expert_parallel(param)


def _clip_grad_norm_(torch_clip_grad_norm_):
    @functools.wraps(torch_clip_grad_norm_)
    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        else:
            params = list(parameters)
            if not params and isinstance(parameters, types.GeneratorType):
                parameters = (p for p in params)  # torch warns of an exhausted generator: let it
        if not any(in_parallel_model(p) for p in params):
            return torch_clip_grad_norm_(params if params else parameters, max_norm, norm_type=norm_type,
                                         error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        if not float(norm_type) > 0:
            raise ValueError(f"clip_grad_norm_ with norm_type={norm_type} on a parallelized model's parameters: "
                             "nxd_hf computes the whole model's p-norm for p > 0 (or inf); use norm_type=2.0")
        return clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    clip_grad_norm_.nxd_hf_routes_parallel_models = True
    return clip_grad_norm_


def install() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (and its home module's name, which the deprecated
    ``clip_grad_norm`` calls) once; a second call changes nothing."""
    if getattr(torch.nn.utils.clip_grad_norm_, "nxd_hf_routes_parallel_models", False):
        return
    wrapper = _clip_grad_norm_(torch.nn.utils.clip_grad_norm_)
    torch.nn.utils.clip_grad_norm_ = wrapper
    torch_clip_grad.clip_grad_norm_ = wrapper
