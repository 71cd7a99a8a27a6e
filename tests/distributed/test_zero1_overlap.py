"""ZeRO-1's reduce-scatter starts per bucket during backward (counted through the
real gradient hooks and collectives) and steps bitwise as the reduce-scatter in ``step()``, at dp=2
and tp=2 x dp=2 (sequence parallelism: norms' gradients summed over TP after backward), with
accumulation under ``no_sync``; old contiguous-layout ``state_dict``s still load."""

import copy

import pytest
import torch

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.optim import NeuronZero1Optimizer
from support import hf_parity


BUCKET_MB = 0.02  # many buckets: most start before backward ends
LR = 1e-3


def _model(sp: bool):
    _ref, model = hf_parity.build_pair("llama", attention_bias=False)
    return nxd_hf.parallelize(model, tensor_parallel_size=parallel_state.get_tensor_model_parallel_size(),
                              sequence_parallel=sp)


def _groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]


def _step(model, optimizer, step: int, accumulate: int):
    """One optimizer step of ``accumulate`` micro-steps (all but the last under no_sync) on this DP
    rank's rows; (reduce-scatters issued inside the last backward, inside step(), buckets started
    from a gradient hook)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    for micro in range(accumulate):
        ids, labels = hf_parity.batch(seed=100 * step + 10 * micro + dp_rank, b=2, s=8)
        loss = model(input_ids=ids, labels=labels).loss / accumulate
        if micro < accumulate - 1:
            with model.no_sync():
                loss.backward()
            continue
        with backend.count_comm() as in_backward:
            loss.backward()
    with backend.count_comm() as in_step:
        optimizer.step()
    optimizer.zero_grad()
    overlap = optimizer._overlap
    zero1 = [[r for r in records if r.op == "reduce_scatter" and r.tag == "zero1"] for records in (in_backward, in_step)]
    return (len(zero1[0]), len(zero1[1]),
            overlap.started_in_backward if overlap is not None else 0)


def check_overlap_matches_step_reduce_scatter(sp: bool, accumulate: int) -> None:
    torch.manual_seed(0)
    runs = {}
    for overlap in (True, False):
        model = _model(sp)
        optimizer = NeuronZero1Optimizer(_groups(model), torch.optim.AdamW, lr=LR, max_norm=0.5,
                                         bucket_size_mb=BUCKET_MB, overlap_reduce_scatter=overlap)
        counts = [_step(model, optimizer, step, accumulate) for step in range(3)]
        buckets = sum(len(fg.buckets()) for fg in optimizer.flat_groups)
        for in_backward, in_step, from_hooks in counts:
            if overlap:  # every bucket's reduce-scatter before backward returned, most from a gradient hook
                assert (in_backward, in_step) == (buckets, 0), (in_backward, in_step, buckets)
                assert from_hooks >= buckets // 2, (from_hooks, buckets)
            else:
                assert (in_backward, in_step, from_hooks) == (0, buckets, 0), (in_backward, in_step, buckets)
        runs[overlap] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in runs[True].items():  # the same sums of the same buffers: bitwise
        assert torch.equal(value, runs[False][name]), name


def check_step_without_new_backward_reduces_again() -> None:
    """A second step() with no backward in between reduces the (unchanged) gradients itself."""
    model = _model(False)
    optimizer = NeuronZero1Optimizer(_groups(model), torch.optim.SGD, lr=0.1, grad_clipping=False,
                                     bucket_size_mb=BUCKET_MB)
    ids, labels = hf_parity.batch(seed=parallel_state.get_data_parallel_rank(), b=2, s=8)
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    first = [m.grad.clone() for m in optimizer.masters]
    with backend.count_comm() as records:
        optimizer.step()
    assert any(r.op == "reduce_scatter" for r in records)
    for before, master in zip(first, optimizer.masters):
        torch.testing.assert_close(master.grad, before, rtol=0, atol=0)


class _ContiguousLayout(NeuronZero1Optimizer):
    """The optimizer as it was before the overlapped reduce-scatter: parameters in order, contiguous slices."""

    interleaved_layout = False


def check_contiguous_state_dict_loads_into_interleaved() -> None:
    dp_rank = parallel_state.get_data_parallel_rank()
    old_model = _model(False)
    old = _ContiguousLayout(_groups(old_model), torch.optim.AdamW, lr=LR, max_norm=0.5, bucket_size_mb=BUCKET_MB)
    for step in range(2):
        _step(old_model, old, step, 1)
    saved = copy.deepcopy(old.state_dict())
    del saved["layout"]["interleaved"]  # as written before the interleaved layout existed
    new_model = copy.deepcopy(old_model)
    new = NeuronZero1Optimizer(_groups(new_model), torch.optim.AdamW, lr=LR, max_norm=0.5, bucket_size_mb=BUCKET_MB)
    new.load_state_dict(saved)
    for step in range(2, 4):
        _step(old_model, old, step, 1)
        _step(new_model, new, step, 1)
    for (name, a), b in zip(old_model.named_parameters(), new_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {dp_rank} {name}: {m}")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overlap_matches_step_reduce_scatter_dp2(ranks2, accumulate):
    ranks2.run(check_overlap_matches_step_reduce_scatter, False, accumulate, model_parallel=(1, 1))


def test_step_without_new_backward_reduces_again_dp2(ranks2):
    ranks2.run(check_step_without_new_backward_reduces_again, model_parallel=(1, 1))


def test_contiguous_state_dict_loads_into_interleaved_dp2(ranks2):
    ranks2.run(check_contiguous_state_dict_loads_into_interleaved, model_parallel=(1, 1))


@pytest.mark.parametrize("sp", [False, True])
def test_overlap_matches_step_reduce_scatter_tp2_dp2(ranks4, sp):
    ranks4.run(check_overlap_matches_step_reduce_scatter, sp, 2, model_parallel=(2, 1))
