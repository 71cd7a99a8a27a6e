"""ZeRO-1 (NeuronZero1Optimizer): ten AdamW steps with active gradient clipping, an lr schedule
and two param groups, against single-process torch.optim.AdamW + clip_grad_norm_, at tp2 x dp2,
dp4 with gradient accumulation and tp4 (dp1, replicated K/V; phi3's fused QKV); state bytes, collective counts,
state_dict and sharded save/load round trips. PP x DP with ZeRO-1 is exercised through the
trainer API (test_trainer_api.py), not here."""

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist

from support import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.optim import NeuronZero1Optimizer
from nxd_hf.optim.zero1 import optimizer as zero1
from nxd_hf.parallel_layers.sharding import full_tensor

TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 10
MAX_NORM = 0.5  # the gradient norm of the tiny llama stays above 1: clipping acts every step
LR = 1e-3  # see test_hf_training.py: Adam turns rounding of near-zero gradients into ~lr steps
BUCKET_MB = 0.02  # several buckets per flat group
ADAMW_BYTES_PER_ELEMENT = 3 * 4  # exp_avg + exp_avg_sq + fp32 master


def _param_groups(model):
    """NxD's decay / no-decay split."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "norm" in n or "bias" in n]
    return [{"params": [p for n, p in named if not ("norm" in n or "bias" in n)], "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]


def _batches(b=8, s=8):
    out = []
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=10 + step, b=b, s=s)
        g = torch.Generator().manual_seed(100 + step)
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100  # ignored tokens on every row
        out.append((ids, labels))
    return out


def _lr_lambda(step):
    return 1.0 / (1.0 + 0.2 * step)


def _train_step(model, optimizer, ids, labels, *, dp_rank=0, dp_size=1, accumulate=1):
    """One step on this DP rank's slice of the batch; the loss is normalized by the global
    token count (``num_items_in_batch`` x dp, the DP mean divides it back)."""
    num_items = (labels[:, 1:] != -100).sum() / dp_size
    local_ids, local_labels = ids.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
    total = 0.0
    for micro, (mb_ids, mb_labels) in enumerate(zip(local_ids.chunk(accumulate), local_labels.chunk(accumulate))):
        context = model.no_sync() if micro < accumulate - 1 and hasattr(model, "no_sync") else torch.enable_grad()
        with context:
            loss = model(input_ids=mb_ids, labels=mb_labels, num_items_in_batch=num_items).loss
            loss.backward()
        total += loss.detach()
    if isinstance(optimizer, NeuronZero1Optimizer):
        optimizer.step()
        norm = optimizer.grad_norm
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    optimizer.zero_grad()
    return total, norm


def reference_run():
    reference, _ = hf_parity.build_pair("llama", attention_bias=False)
    optimizer = torch.optim.AdamW(_param_groups(reference), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda)
    losses, norms = [], []
    for ids, labels in _batches():
        loss, norm = _train_step(reference, optimizer, ids, labels)
        schedule.step()
        losses.append(loss)
        norms.append(norm)
    assert min(norms) > MAX_NORM, "clipping must be active"
    return torch.stack(losses), torch.stack(norms), dict(reference.named_parameters())


def _expected_per_step(optimizer, model):
    """(reduce-scatters, all-gathers, norm all-reduces) one step() issues, from the model alone."""
    dp = parallel_state.get_data_parallel_size()
    elements_per_bucket = int(BUCKET_MB * 1024 * 1024) // (dp * 4)
    buckets = 0
    for group in _param_groups(model):
        shard = -(-sum(p.numel() for p in group["params"]) // dp)
        buckets += -(-shard // elements_per_bucket)
    num_norm = (dp > 1) + (parallel_state.get_tensor_model_parallel_size() > 1)
    return (buckets, buckets, num_norm) if dp > 1 else (0, 0, num_norm)


def _check_state_bytes(optimizer, model):
    dp = parallel_state.get_data_parallel_size()
    expected = 0
    for group in _param_groups(model):
        numel = sum(p.numel() for p in group["params"])  # this TP rank's full AdamW state: 12 B/element
        shard = -(-numel // dp)
        expected += ADAMW_BYTES_PER_ELEMENT * shard
        assert 0 <= shard * dp - numel < dp  # padding only
    assert optimizer.optimizer_state_bytes() == expected, (optimizer.optimizer_state_bytes(), expected)


def check_zero1_matches(reference, tp: int, accumulate: int) -> None:
    ref_losses, ref_norms, ref_params = reference
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    groups = {}
    if tp == 1:  # NxD's spelling: every group's rank list
        groups = dict(sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
                      grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = NeuronZero1Optimizer(_param_groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM,
                                         bucket_size_mb=BUCKET_MB, model=model, **groups)
    assert any("nothing to shard" in str(w.message) for w in caught) == (dp_size == 1 and backend.rank() == 0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda)
    losses, norms = [], []
    for step, (ids, labels) in enumerate(_batches()):
        with backend.count_comm() as records:
            loss, norm = _train_step(model, optimizer, ids, labels, dp_rank=dp_rank, dp_size=dp_size,
                                     accumulate=accumulate)
        step_ops = [r.op for r in records if r.tag == "zero1"]
        dp_ranks = tuple(dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
        backward_dp = [r for r in records if r.tag != "zero1" and r.op == "all_reduce" and r.ranks == dp_ranks]
        assert not backward_dp  # the optimizer registered: backward leaves the DP mean to its reduce-scatter
        if step == 0:
            got = tuple(step_ops.count(op) for op in ("reduce_scatter", "all_gather", "all_reduce"))
            assert got == _expected_per_step(optimizer, model), (got, _expected_per_step(optimizer, model))
        schedule.step()
        losses.append(loss)
        norms.append(norm)
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(LR * _lr_lambda(STEPS - 1))
    losses = torch.stack(losses)
    torch.distributed.all_reduce(losses, group=parallel_state.get_data_parallel_group())
    torch.testing.assert_close(losses / dp_size, ref_losses, **TOL)
    torch.testing.assert_close(torch.stack(norms), ref_norms, **TOL)
    for name, param in model.named_parameters():
        full = full_tensor(param)
        torch.testing.assert_close(full, ref_params[name].detach(), **TOL, msg=lambda m: f"tp={tp} {name}: {m}")
    _check_state_bytes(optimizer, model)


def _continue(model, optimizer, params_before, batches, dp_rank, dp_size):
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params_before):
            p.copy_(saved)
    losses = [_train_step(model, optimizer, ids, labels, dp_rank=dp_rank, dp_size=dp_size)[0] for ids, labels in batches]
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def check_round_trips(tmp_dir: str) -> None:
    """Two steps after restoring from state_dict / save_sharded_state_dict equal two steps of
    the optimizer that was saved, bit for bit."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()

    def new_optimizer():
        return NeuronZero1Optimizer(_param_groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM,
                                    bucket_size_mb=BUCKET_MB, model=model)

    optimizer = new_optimizer()
    batches = _batches()
    for ids, labels in batches[:3]:
        _train_step(model, optimizer, ids, labels, dp_rank=dp_rank, dp_size=dp_size)
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.save_sharded_state_dict(tmp_dir)
    params_before = [p.detach().clone() for p in model.parameters()]
    expected = _continue(model, optimizer, params_before, batches[3:5], dp_rank, dp_size)
    restored = new_optimizer()
    restored.load_state_dict(saved)
    got = _continue(model, restored, params_before, batches[3:5], dp_rank, dp_size)
    from_disk = new_optimizer()
    from_disk.load_sharded_state_dict(tmp_dir, num_workers_per_step=1)
    got_disk = _continue(model, from_disk, params_before, batches[3:5], dp_rank, dp_size)
    for losses, params in (got, got_disk):
        assert torch.equal(losses, expected[0])
        assert all(torch.equal(a, b) for a, b in zip(params, expected[1]))
    parallel_state.destroy_model_parallel()
    nxd_hf.parallel_state.initialize_model_parallel(4)  # another layout: a clear error
    other = NeuronZero1Optimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.AdamW)
    with pytest.raises(ValueError, match="another layout"):
        other.load_state_dict(saved)


def check_grad_norm_fused_qkv() -> None:
    """Per-row ``num_replicas`` (phi3's fused qkv_proj with K/V copied over tp 4) in the norm."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("phi3")
    nxd_hf.parallelize(model, tensor_parallel_size=4)
    assert any(isinstance(getattr(p, "num_replicas", 1), torch.Tensor) for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dp 1
        optimizer = NeuronZero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.0, max_norm=1e9)
    ids, labels = hf_parity.batch()
    model(input_ids=ids, labels=labels).loss.backward()
    reference(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    torch.testing.assert_close(optimizer.grad_norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9), **TOL)


def with_small_chunks(check, *args) -> None:
    """``check(*args)`` with several inner-optimizer chunks per shard (the module default restored after)."""
    default, zero1.OPTIMIZER_CHUNK_NUMEL = zero1.OPTIMIZER_CHUNK_NUMEL, 1000
    try:
        check(*args)
    finally:
        zero1.OPTIMIZER_CHUNK_NUMEL = default


@functools.cache
def _cached_reference_run():
    """The single-process reference, computed once per rank process (the pool keeps it alive)."""
    return reference_run()


def zero1_matches_reference(tp: int, accumulate: int) -> None:
    check_zero1_matches(_cached_reference_run(), tp=tp, accumulate=accumulate)


def test_zero1_matches_adamw_with_clipping_tp2_dp2(ranks4):
    ranks4.run(with_small_chunks, zero1_matches_reference, 2, 1)


def test_zero1_matches_adamw_with_clipping_dp4_no_sync_accumulation(ranks4):
    ranks4.run(with_small_chunks, zero1_matches_reference, 1, 2)


def test_zero1_matches_adamw_with_clipping_tp4_dp1_replicated_kv(ranks4):
    ranks4.run(with_small_chunks, zero1_matches_reference, 4, 1)


def test_grad_norm_counts_fused_qkv_kv_replicas_tp4(ranks4):
    ranks4.run(with_small_chunks, check_grad_norm_fused_qkv)


def test_state_dict_and_sharded_save_round_trips_are_bit_exact(ranks4, tmp_path):
    ranks4.run(with_small_chunks, check_round_trips, str(tmp_path))


def test_non_elementwise_optimizer_is_a_clear_error():
    params = [torch.nn.Parameter(torch.zeros(4))]
    for optimizer_class in (torch.optim.LBFGS, torch.optim.Adafactor):
        with pytest.raises(ValueError, match="element-wise"):
            NeuronZero1Optimizer(params, optimizer_class)
    with pytest.warns(UserWarning, match="nothing to shard"):  # dp 1 (no parallel_state); opted in
        NeuronZero1Optimizer(params, torch.optim.Adafactor, elementwise=True)


def test_dp1_steps_like_the_inner_optimizer(monkeypatch):
    """At DP 1 (a warning) the step is the inner optimizer's, with bf16 + fp32 params in one group."""
    monkeypatch.setattr(zero1, "OPTIMIZER_CHUNK_NUMEL", 7)  # chunk boundaries inside params
    parallel_state.destroy_model_parallel()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3).to(torch.bfloat16))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="nothing to shard"):
        optimizer = NeuronZero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                                         grad_clipping=False)
    assert len(optimizer.flat_groups) == 2  # one per dtype
    masters = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    ref_optimizer = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    x = torch.randn(4, 6)
    for _ in range(3):
        model[1](model[0](x).bfloat16()).float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        for master, p in zip(masters, reference.parameters()):
            p.data.copy_(master.data)
        reference[1](reference[0](x).bfloat16()).float().square().sum().backward()
        for master, p in zip(masters, reference.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        ref_optimizer.step()
    for p, master in zip(model.parameters(), masters):
        assert torch.equal(p, master.to(p.dtype))


def test_grad_source_reduces_fp32_main_grad():
    """``grad_source`` (the trainer's fp32 ``main_grad`` of a bf16 param) is reduced in fp32, and
    zero_grad clears it."""
    parallel_state.destroy_model_parallel()
    param = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    param.main_grad = torch.full((5,), 0.1)
    with pytest.warns(UserWarning, match="nothing to shard"):
        optimizer = NeuronZero1Optimizer([param], torch.optim.SGD, lr=1.0, grad_source=lambda p: p.main_grad,
                                         grad_clipping=False)
    optimizer.step()
    assert torch.equal(optimizer.masters[0], torch.ones(5) - torch.full((5,), 0.1))  # no bf16 rounding of the grad
    assert torch.equal(param, optimizer.masters[0].bfloat16())
    optimizer.zero_grad()
    assert param.main_grad is None and param.grad is None


def test_grad_norm_of_a_long_shard_is_accurate():
    """A shard's norm as one slice of millions of elements (CPU's serial vector_norm drifts ~1e-4 over
    it): the float64 norm to fp32 rounding, as Trainer's per-parameter norms give it."""
    parallel_state.destroy_model_parallel()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3_000_000, 1_000_001, 7)]
    for param in params:
        param.grad = torch.randn(param.shape) * 1e-2
        param.grad[:50] *= 100  # a few large entries, as an embedding's used rows
    with pytest.warns(UserWarning, match="nothing to shard"):
        optimizer = NeuronZero1Optimizer(params, torch.optim.SGD, lr=0.0, max_norm=1e9)
    want = torch.cat([p.grad.double() for p in params]).norm().item()
    optimizer.step()
    assert optimizer.grad_norm.item() == pytest.approx(want, rel=2e-6)
