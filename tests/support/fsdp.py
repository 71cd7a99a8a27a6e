"""What the FSDP test files share: the data, one step (loss normalized by the global token count,
backward, clipping), the checks of one step and of the parameters against the one-process model,
and gathered states for checkpoint round trips."""

import torch

from support import hf_parity
import nxd_hf
from nxd_hf.fsdp import logical_tensor

TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 4
MAX_NORM = 1.0
LR = 1e-3
GLOBAL_BATCH = 4


def batches():
    out = []
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=10 + step, b=GLOBAL_BATCH, s=8)
        g = torch.Generator().manual_seed(100 + step)
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100  # ignored tokens on every row
        out.append((ids, labels))
    return out


def train_step(model, ids, labels, *, dp_rank: int, dp_size: int, clip):
    """Forward and backward of this DP rank's rows; the loss is normalized by the global token count
    (x dp: the DP mean divides it back), then the gradients are clipped. Returns (loss, norm)."""
    num_items = (labels[:, 1:] != -100).sum() / dp_size
    ids, labels = ids.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
    loss.backward()
    return loss.detach(), clip(model.parameters(), MAX_NORM)


def logical_grad(param):
    full = logical_tensor(param, param.grad)
    return full.t() if getattr(param, "hf_transposed", False) else full


def check_step_and_step(label: str, model, reference, optimizers, *, loss, ref_loss, norm, ref_norm) -> None:
    """One step's checks against the one-process model (clipping acted; loss, norm, every gathered
    gradient), then both optimizers step. ``loss``: already the mean over the data-parallel ranks."""
    assert ref_norm > MAX_NORM, "clipping must act"
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(norm, ref_norm, **TOL)
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    for name, param in model.named_parameters():
        torch.testing.assert_close(logical_grad(param), ref_grads[name], **TOL, msg=lambda m: f"{label} grad {name}: {m}")
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def check_params(label: str, model, reference) -> None:
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        torch.testing.assert_close(logical_tensor(param), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"{label} param {name}: {m}")



def full_states(model, optimizer) -> tuple[dict, dict]:
    from nxd_hf.checkpoint import full_optimizer_state

    return nxd_hf.full_state_dict(model), full_optimizer_state(model, optimizer)


def assert_same_states(saved: tuple[dict, dict], loaded: tuple[dict, dict], what: str) -> None:
    from support.moe_ep import assert_same_states

    for a, b in zip(saved, loaded):
        assert set(a) == set(b), (what, set(a) - set(b), set(b) - set(a))
    assert_same_states(saved, loaded, what)


