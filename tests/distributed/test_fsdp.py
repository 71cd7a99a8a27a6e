"""ZeRO-3 / ZeRO-2 on torch's FSDP2 over nxd_hf's data-parallel ranks (``data_parallel_sharding``):
several AdamW steps with active gradient clipping against the one-process HF model (loss, norm,
every gathered gradient, the parameters), at dp=2 and tp=2 x dp=2 (+SP); exact bytes per rank of
parameters, gradients and optimizer state; what is refused."""

import pytest
import torch

import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.fsdp import is_dp_sharded, logical_tensor
from nxd_hf.parallel_layers.grads import clip_grad_norm

TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 4
MAX_NORM = 1.0
LR = 1e-3
GLOBAL_BATCH = 4


def _batches():
    out = []
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=10 + step, b=GLOBAL_BATCH, s=8)
        g = torch.Generator().manual_seed(100 + step)
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100  # ignored tokens on every row
        out.append((ids, labels))
    return out


def _step(model, ids, labels, *, dp_rank: int, dp_size: int, clip):
    """Forward and backward of this DP rank's rows; the loss is normalized by the global token count
    (x dp: the DP mean divides it back), then the gradients are clipped. Returns (loss, norm)."""
    num_items = (labels[:, 1:] != -100).sum() / dp_size
    ids, labels = ids.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss
    loss.backward()
    return loss.detach(), clip(model.parameters(), MAX_NORM)


def _logical_grad(param):
    full = logical_tensor(param, param.grad)
    return full.t() if getattr(param, "hf_transposed", False) else full


def check_fsdp_matches_hf(mode: str, tp: int, sp: bool) -> None:
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp, data_parallel_sharding=mode)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    assert dp_size == 2 and all(is_dp_sharded(p) for p in model.parameters())
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_grads = {}
    for step, (ids, labels) in enumerate(_batches()):
        ref_loss, ref_norm = _step(reference, ids, labels, dp_rank=0, dp_size=1, clip=torch.nn.utils.clip_grad_norm_)
        loss, norm = _step(model, ids, labels, dp_rank=dp_rank, dp_size=dp_size, clip=clip_grad_norm)
        assert ref_norm > MAX_NORM, "clipping must act"
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        torch.testing.assert_close(loss / dp_size, ref_loss, **TOL)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for name, param in model.named_parameters():
            torch.testing.assert_close(_logical_grad(param), ref_grads[name], **TOL,
                                       msg=lambda m: f"{mode} tp={tp} step {step} grad {name}: {m}")
        ref_optimizer.step()
        optimizer.step()
        ref_optimizer.zero_grad()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(logical_tensor(param), dict(reference.named_parameters())[name].detach(), **TOL,
                                   msg=lambda m: f"{mode} tp={tp} param {name}: {m}")


def test_zero3_matches_hf_dp2(ranks2):
    ranks2.run(check_fsdp_matches_hf, "zero3", 1, False)


def test_zero2_matches_hf_dp2(ranks2):
    ranks2.run(check_fsdp_matches_hf, "zero2", 1, False)


def test_zero3_matches_hf_tp2_dp2_sequence_parallel(ranks4):
    ranks4.run(check_fsdp_matches_hf, "zero3", 2, True)
