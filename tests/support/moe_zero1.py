"""ZeRO-1 with expert parallelism, the step comparison shared by test_moe_zero1.py and the Llama 4
test: parameter groups, clipping and AdamW against single-process HF + torch AdamW."""

import torch
from support.moe_ep import TOL


LR = 1e-3  # parameters compared after Adam steps: at lr 1e-3 a rounding-noise gradient moves its element ~1e-6
MAX_NORM = 0.05  # below the tiny models' gradient norms: clipping acts every step


def param_groups(model) -> list[dict]:
    """A decay / no-decay split (the expert tensors land in the decay group)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]


def zero1_backward(loss: torch.Tensor) -> torch.Tensor:
    from nxd_hf import backend, parallel_state

    loss.backward()
    mean = loss.detach() / parallel_state.get_data_parallel_size()
    backend.all_reduce(mean, parallel_state.get_data_parallel_group())
    return mean


def assert_step_matches(model, optimizer, ref_params: dict, loss, ref_loss, ref_norm, step: int) -> None:
    """After a ZeRO-1 step: the DP-mean loss, the clipped grad norm (clipping acted) and every
    gathered parameter equal the reference's."""
    from nxd_hf.parallel_layers.sharding import full_tensor

    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert ref_norm > MAX_NORM
    torch.testing.assert_close(optimizer.grad_norm, ref_norm, **TOL, msg=lambda m: f"step {step} norm: {m}")
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"step {step} {name}: {m}")
