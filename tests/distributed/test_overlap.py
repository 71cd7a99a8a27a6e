"""Each bucket's data-parallel all-reduce starts during backward; the
gradients are bitwise those of the all-reduce after backward, at dp=2 and tp=2 x dp=2, with
sequence parallelism (partial gradients summed over TP), a tied head and accumulation under
``no_sync``."""

import pytest
import torch

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.backend import count_comm
from nxd_hf.parallel_layers.grads import accumulated_grad, all_reduce_bucketed
from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp
from support import hf_parity


def _model(bucket_size_mb: float, sp: bool, tie: bool):
    _ref, model = hf_parity.build_pair("llama", tie_word_embeddings=tie)
    return nxd_hf.parallelize(model, tensor_parallel_size=parallel_state.get_tensor_model_parallel_size(),
                              sequence_parallel=sp, bucket_size_mb=bucket_size_mb)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: accumulated_grad(p).clone() for n, p in model.named_parameters() if accumulated_grad(p) is not None}


def _steps(model, *, overlap: bool, accumulate: bool):
    """One step (two micro-steps, the first under no_sync, when ``accumulate``) on this DP
    rank's rows; the gradients, the buckets started during the last backward, the DP records."""
    policy = model.nxd.grad_reduction
    policy.overlap = overlap
    model.zero_grad(set_to_none=True)
    dp_rank = parallel_state.get_data_parallel_rank()
    if accumulate:
        ids, labels = hf_parity.batch(seed=10 + dp_rank, b=2, s=8)
        with model.no_sync():
            model(input_ids=ids, labels=labels).loss.backward()
    ids, labels = hf_parity.batch(seed=1 + dp_rank, b=2, s=8)
    loss = model(input_ids=ids, labels=labels).loss
    with count_comm() as records:
        loss.backward()
    dp_ranks = None if parallel_state.get_data_parallel_size() == 1 else set(
        torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    dp_records = [r for r in records if set(r.ranks) == dp_ranks]
    return _grads(model), policy.buckets.started_in_backward, dp_records


def _after_backward(model, *, accumulate: bool) -> dict[str, torch.Tensor]:
    """The reference: every backward under no_sync, then one bucketed all-reduce of all gradients
    (the reduction as it was before the overlap)."""
    model.zero_grad(set_to_none=True)
    dp_rank = parallel_state.get_data_parallel_rank()
    with model.no_sync():
        for seed in ([10 + dp_rank] if accumulate else []) + [1 + dp_rank]:
            ids, labels = hf_parity.batch(seed=seed, b=2, s=8)
            model(input_ids=ids, labels=labels).loss.backward()
    grads = [accumulated_grad(p) for p in model.parameters() if accumulated_grad(p) is not None]
    dp_size = parallel_state.get_data_parallel_size()
    all_reduce_bucketed(grads, parallel_state.get_data_parallel_group(), scale=1.0 / dp_size)
    return _grads(model)


def check_overlap_matches_reduction_after_backward(sp: bool, tie: bool, accumulate: bool) -> None:
    assert parallel_state.get_data_parallel_size() == 2
    model = _model(1e-9, sp, tie)  # a bucket per parameter: the most buckets to order
    overlapped, started, records = _steps(model, overlap=True, accumulate=accumulate)
    plain, started_plain, records_plain = _steps(model, overlap=False, accumulate=accumulate)
    reference = _after_backward(model, accumulate=accumulate)
    assert overlapped.keys() == plain.keys() == reference.keys()
    for name in reference:
        assert torch.equal(overlapped[name], reference[name]), name
        assert torch.equal(plain[name], reference[name]), name
    params = [p for p in model.parameters() if p.requires_grad]
    bucketed = [p for p in params if not has_partial_grad_over_tp(p)]
    assert len(model.nxd.grad_reduction.buckets.buckets) == len(bucketed)
    assert started == len(bucketed) and started_plain == 0  # every bucket started before backward ended
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    for dp_records in (records, records_plain):
        assert sum(r.payload_bytes for r in dp_records) == grad_bytes, dp_records
        assert len(dp_records) == len(params), dp_records  # the rest: also a bucket per parameter


def check_one_bucket_of_everything() -> None:
    """bucket_size_mb large: one buffer, one all-reduce over DP of all gradient bytes."""
    model = _model(1000.0, sp=False, tie=False)
    grads, started, records = _steps(model, overlap=True, accumulate=False)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(model.nxd.grad_reduction.buckets.buckets) == 1 and started == 1
    assert [r.payload_bytes for r in records] == [sum(p.numel() * p.element_size() for p in params)]
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)  # the buffer goes at the next forward, the gradients are None
    model(input_ids=hf_parity.batch()[0])
    assert model.nxd.grad_reduction.buckets.buckets[0].flat is None


def check_heap_trimmed_before_the_head() -> None:
    """On CPU the freed heap is returned before the LM head in a training forward (the step's
    peak is the logits and the loss on top of the layers' freed temporaries); not in eval."""
    import nxd_hf.parallel_layers.grad_reduction as grad_reduction

    model = _model(25, sp=False, tie=False)
    events, trim = [], grad_reduction.release_free_host_memory
    model.model.layers[-1].register_forward_hook(lambda *_: events.append("last layer"))
    model.lm_head.register_forward_hook(lambda *_: events.append("head"))
    grad_reduction.release_free_host_memory = lambda: events.append("trim") or trim()
    try:
        ids, labels = hf_parity.batch(seed=1, b=2, s=8)
        model(input_ids=ids, labels=labels).loss.backward()
        assert events[events.index("last layer"):events.index("head") + 1] == ["last layer", "trim", "head"], events
        events.clear()
        with torch.no_grad():
            model(input_ids=ids, labels=labels)
        assert events == ["last layer", "head"], events
    finally:
        grad_reduction.release_free_host_memory = trim


@pytest.mark.parametrize("sp,tie,accumulate", [(False, False, False), (False, True, True)])
def test_overlap_bitwise_dp2(ranks2, sp, tie, accumulate):
    ranks2.run(check_overlap_matches_reduction_after_backward, sp, tie, accumulate,
               model_parallel=(1, 1))


def test_one_bucket_dp2(ranks2):
    ranks2.run(check_one_bucket_of_everything, model_parallel=(1, 1))


@pytest.mark.parametrize("sp,tie,accumulate", [(False, False, False), (True, True, True)])
def test_overlap_bitwise_tp2_dp2(ranks4, sp, tie, accumulate):
    ranks4.run(check_overlap_matches_reduction_after_backward, sp, tie, accumulate,
               model_parallel=(2, 1))


def test_heap_trimmed_before_the_head(ranks2):
    ranks2.run(check_heap_trimmed_before_the_head, model_parallel=(2, 1))
