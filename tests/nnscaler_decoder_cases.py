"""A plain-PyTorch decoder (``nnscaler_models.MaskDecoder``: ``torch.ones(S, S).tril()``, ``x.shape``,
``view``, SDPA) parallelized by ``nxd_hf.nnscaler.parallelize`` with each builtin policy, trained
with ``build_optimizer``'s Adam against the same module in one process: losses, gradient norms,
the merged state dict (and its round trips through ``load_merged_state_dicts`` and the deduped
state dicts). Run on every rank of a pool (``tests/distributed/test_nnscaler_core.py``)."""

import copy

import torch

from nnscaler_models import TOL, MaskDecoder
from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler import (
    ComputeConfig, build_optimizer, deduped_state_dict, load_deduped_state_dict, load_merged_state_dicts,
    merge_state_dicts, parallelize,
)

ADAM = dict(lr=1e-2, eps=1e-3)  # eps above the gradients' fp32 rounding noise (see nnscaler_state_cases)
NUM_SAMPLES = 2


def _samples(step: int, unit: int, seq: int = 8):
    g = torch.Generator().manual_seed(1000 * step + 10 * unit)
    return [{"input_ids": torch.randint(0, 32, (2, seq), generator=g), "labels": torch.randint(0, 32, (2, seq), generator=g)}
            for _ in range(NUM_SAMPLES)]


def _merged(pm, optimizer):
    module_sds = backend.all_gather_object(pm.state_dict())
    optimizer_sds = backend.all_gather_object(optimizer.state_dict())
    return merge_state_dicts(module_sds, optimizer_sds)


def _assert_equal_state(module_sd, optimizer_sd, ref, ref_opt, what: str):
    want = ref.state_dict()
    assert set(module_sd) == set(want), (what, set(module_sd) ^ set(want))
    for name, value in want.items():
        torch.testing.assert_close(module_sd[name], value, **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")
    for index, state in ref_opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer_sd["state"][index][key], value, **TOL,
                                       msg=lambda m, index=index, key=key: f"{what} optimizer {index} {key}: {m}")


def _scramble(pm):
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)


def decoder_matches(tmp: str, policy: str, plan: int, runtime: int, zero: bool = False, steps: int = 3):
    """See the module docstring; ``parallelize`` of a module in eval mode gives one in eval mode."""
    parallel_state.destroy_model_parallel()
    ref = MaskDecoder().eval()
    config = ComputeConfig(plan, runtime, use_end2end=True, use_zero=zero,
                           pas_config={"pipeline_nmicros": NUM_SAMPLES, "pipeline_nstages": 2})
    pm = parallelize(copy.deepcopy(ref), {"data": _samples(0, 0)[0]}, policy, config, gen_savedir=tmp)
    assert not pm.training and not ref.training
    pm.train(), ref.train()
    optimizer, ref_opt = build_optimizer(pm, torch.optim.Adam, **ADAM), torch.optim.Adam(ref.parameters(), **ADAM)
    units, unit = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    for step in range(steps):
        losses = pm.train_step(_samples(step + 1, unit))
        norm = optimizer.clip_gnorm()
        optimizer.step()
        ref_opt.zero_grad()
        ref_losses = [[ref(s)[0] for s in _samples(step + 1, u)] for u in range(units)]
        (sum(sum(per_unit) for per_unit in ref_losses) / units).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        ref_opt.step()
        for out, want in zip(losses, ref_losses[unit]):  # pipelined: the losses; else (loss, logits)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            torch.testing.assert_close(loss.float(), want.detach(), **TOL)
        torch.testing.assert_close(norm.float().cpu(), ref_norm, **TOL)
    module_sd, optimizer_sd = _merged(pm, optimizer)
    _assert_equal_state(module_sd, optimizer_sd, ref, ref_opt, f"{policy} merged")
    original = MaskDecoder()
    original.load_state_dict(module_sd)  # strict: the original module's keys, nothing else
    _scramble(pm)
    load_merged_state_dicts(pm, module_sd, optimizer, optimizer_sd)
    _assert_equal_state(*_merged(pm, optimizer), ref, ref_opt, f"{policy} load_merged")
    deduped = deduped_state_dict(pm, optimizer)
    _scramble(pm)
    load_deduped_state_dict(pm, deduped[0], optimizer, deduped[1])
    _assert_equal_state(*_merged(pm, optimizer), ref, ref_opt, f"{policy} deduped")
    pm.eval(), ref.eval(), original.eval()
    eval_samples = _samples(99, unit)
    with torch.no_grad():
        want = [ref(s)[0] for s in eval_samples]
        for got, w in zip(pm.infer_step(eval_samples), want):
            torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, w, **TOL)
        torch.testing.assert_close(original(eval_samples[0])[0], want[0], **TOL)
