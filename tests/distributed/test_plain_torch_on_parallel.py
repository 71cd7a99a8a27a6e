"""Plain torch calls on a parallelized model, as a loop or a Trainer written for plain HF makes them.

``torch.nn.utils.clip_grad_norm_`` on its parameters is the whole model's norm
(``nxd_hf.parallel_layers.torch_clip``): at tp=2 (K/V replicated, vocab padded), pp=2 and ep=2
the norms, the clipped AdamW steps and the trained weights equal plain HF's with torch's own
function; torch's own result is untouched for any other parameters; nan gradients raise as torch
does, on every rank. ``DistributedDataParallel`` (plain ``transformers.Trainer`` under torchrun,
a loop's ``DDP(model)``) is refused with a ValueError before it overwrites a shard
(``nxd_hf.guards.no_ddp``). ``GradScaler`` skips a step on every rank when one rank's shard
overflows, as plain HF's skips it (``nxd_hf.parallel_layers.grad_scaler``)."""

import math
import warnings

import pytest
import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.backend import count_comm
from nxd_hf.guards.no_ddp import MESSAGE
from nxd_hf.parallel_layers import torch_clip
from nxd_hf.parallel_layers.sharding import full_tensor
from tests.support import hf_parity, moe_ep

TOL = dict(rtol=1e-4, atol=1e-5)
MAX_NORM = 0.1  # below every step's norm here: each step really clips (asserted)


def _adamw(params):
    # Adam turns the rounding of a near-zero gradient (a key bias's) into a step of ~lr; eps bounds that
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)


def _forward_backward(model, inputs) -> torch.Tensor:
    loss = model(**inputs).loss
    loss.backward()
    return loss


def _train_alike(reference, model, step_inputs, *, norm_type=2.0, run_step=_forward_backward) -> None:
    """AdamW steps clipped by torch's ``clip_grad_norm_`` on both models: loss, norm, weights."""
    params = list(model.parameters())
    ref_opt, opt = _adamw(reference.parameters()), _adamw(params)
    for step, inputs in enumerate(step_inputs):
        ref_loss = _forward_backward(reference, inputs)
        loss = run_step(model, inputs)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type=norm_type)
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=norm_type)
        assert ref_norm > MAX_NORM, (step, ref_norm)
        torch.testing.assert_close(norm.to(ref_norm.dtype), ref_norm, **TOL, msg=lambda m: f"step {step} norm: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    named = model.local_named_parameters() if hasattr(model, "local_named_parameters") else model.named_parameters()
    for name, param in named:  # gathered over TP and over the expert-parallel ranks
        torch.testing.assert_close(full_tensor(param, param.detach()), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"{name}: {m}")


def _llama_steps(steps=3, b=2):
    return [dict(zip(("input_ids", "labels"), hf_parity.batch(seed=10 + step, b=b))) for step in range(steps)]


def check_tp2(norm_type) -> None:
    reference, model = hf_parity.build_pair("llama", num_key_value_heads=1)  # kv_heads < tp: replicated K/V
    model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    _train_alike(reference, model, _llama_steps(), norm_type=norm_type)


def check_pp2() -> None:
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2,
                                  broadcast_and_average_loss=True)
    _train_alike(reference, pp_model, _llama_steps(b=4), run_step=lambda model, inputs: model.run_train(**inputs))


def check_ep2() -> None:
    """Both data-parallel ranks see the same batch, so the DP mean is that batch's gradient."""
    reference, model = moe_ep.build_pair("mixtral")
    model = nxd_hf.parallelize(model, expert_parallel_size=2)
    steps = [dict(zip(("input_ids", "labels"), moe_ep.batch(seed=10 + step))) for step in range(3)]
    _train_alike(reference, model, steps)


def check_nonfinite_and_norm_types() -> None:
    reference, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    ids, labels = hf_parity.batch()
    model(input_ids=ids, labels=labels).loss.backward()
    reference(input_ids=ids, labels=labels).loss.backward()
    with warnings.catch_warnings():  # the deprecated name calls the routed one
        warnings.simplefilter("ignore", FutureWarning)
        deprecated = torch.nn.utils.clip_grad_norm(model.parameters(), math.inf)
    torch.testing.assert_close(deprecated, torch.nn.utils.clip_grad_norm_(reference.parameters(), math.inf), **TOL)
    with pytest.raises(ValueError, match="norm_type=0"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=0)
    sharded = model.model.layers[0].mlp.down_proj.weight  # one rank's shard only
    if parallel_state.get_tensor_model_parallel_rank() == 1:
        sharded.grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="non-finite"):  # on both ranks: the norm is the whole model's
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    for p, b in zip(model.parameters(), before):  # nothing scaled
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))  # torch's default: no error


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_torch_clip_grad_norm_tp2_trains_as_plain_hf(ranks2, norm_type):
    ranks2.run(check_tp2, norm_type)


def test_torch_clip_grad_norm_pp2_trains_as_plain_hf(ranks2):
    ranks2.run(check_pp2)


def test_torch_clip_grad_norm_ep2_trains_as_plain_hf(ranks2):
    ranks2.run(check_ep2)


def test_torch_clip_grad_norm_nonfinite_deprecated_and_norm_types_tp2(ranks2):
    ranks2.run(check_nonfinite_and_norm_types)


def test_plain_parameters_get_torchs_own_result():
    """Parameters of no parallel model: exactly torch's function, bit for bit, and the wrapper
    is installed once, under both of torch's names."""
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_
    installed = torch.nn.utils.clip_grad_norm_
    torch_clip.install()
    assert torch.nn.utils.clip_grad_norm_ is installed and installed.nxd_hf_routes_parallel_models
    torch_own = installed.__wrapped__
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c in zip(params, copies):
        c.grad = p.grad.clone()
    for norm_type in (2.0, 1.0, math.inf, 0.0):
        assert torch.equal(installed(params, 0.1, norm_type), torch_own(copies, 0.1, norm_type))
        assert all(torch.equal(p.grad, c.grad) for p, c in zip(params, copies))
    assert torch.equal(installed(params[0], 0.1), torch_own(copies[0], 0.1))
    with pytest.warns(UserWarning, match="empty generator"):  # torch's own warning, kept
        installed((p for p in []), 1.0)


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def check_ddp_refused(out_dir) -> None:
    """Plain ``transformers.Trainer`` first (its accelerate state as torchrun gives it: several
    CPU processes), then DDP on the model, on a peft wrapper of it and on a pipeline."""
    _, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    before = _weights(model)
    ids, labels = hf_parity.batch(b=8)
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    assert args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED  # as under torchrun
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=[dict(input_ids=i, labels=l) for i, l in zip(ids, labels)])
    with pytest.raises(ValueError, match="use nxd_hf.NxDTrainer"):
        trainer.train()
    assert _unchanged(model, before)  # rank 1's shards are still its own
    with pytest.raises(ValueError) as raised:
        DistributedDataParallel(model)
    assert str(raised.value) == MESSAGE
    import peft

    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="do not wrap it in torch's DistributedDataParallel"):
        DistributedDataParallel(adapted)
    assert DistributedDataParallel(torch.nn.Linear(2, 2)).module.weight.shape == (2, 2)  # other modules: DDP as ever


def check_ddp_refused_pp2() -> None:
    _, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2)
    before = _weights(pp_model)
    with pytest.raises(ValueError, match="use nxd_hf.NxDTrainer"):
        DistributedDataParallel(pp_model)
    assert _unchanged(pp_model, before)


def test_ddp_and_plain_trainer_refused_tp2(ranks2, tmp_path):
    ranks2.run(check_ddp_refused, str(tmp_path))


def test_ddp_refused_pp2(ranks2):
    ranks2.run(check_ddp_refused_pp2)


def check_grad_scaler_skips_together() -> None:
    """Three steps with ``torch.amp.GradScaler``, unscaled and clipped by torch's functions; at
    step 1 one gradient element of the last TP rank's shard is inf (in the reference: the same
    logical element). Both skip step 1 and halve the scale, on every rank; the weights agree."""
    reference, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, tensor_parallel_size=2)
    ref_opt, opt = _adamw(reference.parameters()), _adamw(model.parameters())
    ref_scaler, scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2))
    sharded, ref_twin = model.model.layers[0].mlp.down_proj.weight, reference.model.layers[0].mlp.down_proj.weight
    last_column = ref_twin.shape[1] - 1  # row-parallel: its columns split over TP, the last on the last rank
    for step, inputs in enumerate(_llama_steps()):
        ref_scaler.scale(reference(**inputs).loss).backward()
        scaler.scale(model(**inputs).loss).backward()
        if step == 1:
            ref_twin.grad[0, last_column] = float("inf")
            local = (sharded.shard_index == last_column).nonzero()
            if len(local):
                sharded.grad[0, local[0, 0]] = float("inf")
        with count_comm() as ref_records:
            ref_scaler.unscale_(ref_opt)
        with count_comm() as records:
            scaler.unscale_(opt)
        assert ref_records == [] and [(r.op, r.group_size, r.payload_bytes) for r in records] == [("all_reduce", 2, 4)]
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = _weights(model)
        ref_scaler.step(ref_opt), scaler.step(opt)
        ref_scaler.update(), scaler.update()
        assert _unchanged(model, before) == (step == 1), step  # skipped on this rank exactly when on the other
        assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** (9 if step >= 1 else 10), step
        ref_opt.zero_grad(), opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param, param.detach()), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"{name}: {m}")


def test_grad_scaler_skips_an_overflow_on_every_rank_tp2(ranks2):
    ranks2.run(check_grad_scaler_skips_together)
