"""NxD's training API: config validation, initialize_parallel_model/optimizer against
single-process training (ZeRO-1, TP, PP, DP, accumulation, padded batches), bf16 with fp32
master weights, sequential model building; models that are not Hugging Face's (``own_models``:
built from nxd_hf's parallel layers, or plain torch) at tp=2, pp=2, dp=2 + ZeRO-1 and tp2 x pp2,
their checkpoints across layouts, and the errors that name the fix."""

import pytest
import torch

from support import hf_parity
import nxd_hf
from support import own_models
from nxd_hf import backend, parallel_state
from nxd_hf.modules.lora import LoraConfig
from nxd_hf.parallel_layers.sharding import full_tensor

TOL = hf_parity.TOL
STEPS = 10
MAX_NORM = 0.5  # small enough that clipping is active in every step


def _model_fn(dtype=torch.float32):
    _, model = hf_parity.build_pair("llama", attention_bias=False, num_hidden_layers=4)
    return model.to(dtype)


def _batches(steps=STEPS, b=8, s=8):
    batches = []
    for step in range(steps):
        ids, labels = hf_parity.batch(seed=100 + step, b=b, s=s)
        labels[step % b, 2:] = -100  # padded sequences, a different one every step
        batches.append((ids, labels))
    return batches


def _reference_losses(dtype=torch.float32, steps=STEPS):
    reference = _model_fn(dtype).to(backend.default_device())  # where hf_parity.batch puts the batches
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses = []
    for ids, labels in _batches(steps):
        loss = reference(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), reference


def _train(nxd_config, *, accumulate=1, dtype=torch.float32, steps=STEPS):
    model = nxd_hf.initialize_parallel_model(nxd_config, _model_fn, dtype)
    optimizer = nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for ids, labels in _batches(steps):
        step_tokens = (labels[:, 1:] != -100).sum()  # over the global batch: every micro-step's share
        local_ids, local_labels = ids.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        loss = 0.0
        with backend.count_comm() as records:
            for mb_ids, mb_labels in zip(local_ids.chunk(accumulate), local_labels.chunk(accumulate)):
                loss = loss + model.run_train(input_ids=mb_ids, labels=mb_labels, num_items_in_batch=step_tokens)
        # micro-steps send no gradients over DP (only the scalar loss share): that is step()'s job
        dp_ranks = tuple(next(g for g in parallel_state.get_data_parallel_group(as_list=True)
                              if torch.distributed.get_rank() in g))
        assert all(r.payload_bytes <= 8 for r in records if r.ranks == dp_ranks and dp_size > 1), records
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return torch.stack(losses), model, optimizer


def check_matches_single_process(tp=1, pp=1, zero1=True, accumulate=1) -> None:
    parallel_state.destroy_model_parallel()
    ref_losses, reference = _reference_losses()
    config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pipeline_config={"num_microbatches": 2} if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": MAX_NORM},
    )
    losses, model, _ = _train(config, accumulate=accumulate)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = full_tensor(param)
        torch.testing.assert_close(full, ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def check_bf16_tracks_fp32() -> None:
    """bf16 parameters with fp32 master weights and fp32 grad accumulation: within 2% of the
    fp32 run's loss at each of 20 steps (bf16 rounding makes exact parity impossible)."""
    parallel_state.destroy_model_parallel()
    ref_losses, _ = _reference_losses(steps=20)
    config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=2, optimizer_config={"grad_clipping": True, "max_grad_norm": MAX_NORM})
    losses, model, optimizer = _train(config, accumulate=2, dtype=torch.bfloat16, steps=20)
    assert model.dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for group in optimizer.masters for m in group.masters)
    relative = ((losses.float() - ref_losses) / ref_losses).abs()
    assert relative.max() < 0.02, relative


def check_sequential_build() -> None:
    """sequential_move_factor=1: no two ranks build their model at the same time."""
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(model_init_config={"sequential_move_factor": 1})
    model = nxd_hf.initialize_parallel_model(config, _model_fn)
    intervals = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(intervals, model.build_interval)
    intervals.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(intervals, intervals[1:])), intervals


def check_autocast_around_run_train() -> None:
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2)
    model = nxd_hf.initialize_parallel_model(config, _model_fn)
    ids, labels = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.run_train(input_ids=ids, labels=labels)
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def _own_reference(steps: int):
    reference = own_models.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = reference(*own_models.batch(step))
        loss.backward()
        if step == 0:  # before clipping, as run_train leaves them
            grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), grads, reference


def check_own_model_matches_single_process(parallel: bool, tp=1, pp=1, zero1=False, steps=3, **config) -> None:
    """A model that is not Hugging Face's through the config API (built from nxd_hf's parallel
    layers, or plain torch): losses, first-step gradients and weights after ``steps`` AdamW steps
    with clipping equal one process's."""
    parallel_state.destroy_model_parallel()
    ref_losses, ref_grads, reference = _own_reference(steps)
    nxd_config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=own_models.PIPELINE if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": MAX_NORM}, **config)
    model = nxd_hf.initialize_parallel_model(nxd_config, own_models.build, parallel)
    assert model.nxd.patch is None
    if "activation_checkpoint_config" in config:
        assert any(getattr(m, "_nxd_checkpointed", False) for m in model.modules())
    optimizer = nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for step in range(steps):
        ids, labels = (t.chunk(dp_size)[dp_rank] for t in own_models.batch(step))
        losses.append(model.run_train(input_ids=ids, labels=labels))
        if step == 0:
            for name, param in model.named_parameters():
                grad = full_tensor(param, param.grad).clone()
                if zero1:  # ZeRO-1 takes the DP mean in step() (a reduce-scatter): the grads are this replica's
                    backend.all_reduce(grad, parallel_state.get_data_parallel_group())
                    grad /= dp_size
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"grad {name}: {m}")
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(torch.stack(losses), ref_losses, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


OWN_MODEL_LAYOUTS = {  # world 2
    "parallel_layers_tp2": dict(parallel=True, tp=2),
    "parallel_layers_pp2": dict(parallel=True, pp=2),
    "parallel_layers_dp2_zero1": dict(parallel=True, zero1=True),
    "plain_pp2": dict(parallel=False, pp=2),
    "plain_dp2_zero1": dict(parallel=False, zero1=True),
    "plain_dp2_zero1_full_recompute": dict(parallel=False, zero1=True, activation_checkpoint_config=own_models.Block),
}


@pytest.mark.parametrize("layout", list(OWN_MODEL_LAYOUTS))
def test_own_model_matches_single_process(ranks2, layout):
    ranks2.run(check_own_model_matches_single_process, **OWN_MODEL_LAYOUTS[layout])


def test_own_parallel_layers_model_tp2_pp2_matches_single_process(ranks4):
    ranks4.run(check_own_model_matches_single_process, parallel=True, tp=2, pp=2)


def _own_build(parallel: bool, tp=1, pp=1, zero1=False, seed=0):
    parallel_state.destroy_model_parallel()
    nxd_config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=own_models.PIPELINE if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": MAX_NORM})
    model = nxd_hf.initialize_parallel_model(nxd_config, own_models.build, parallel, seed)
    return model, nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)


def _own_train(model, optimizer, steps: range) -> list[float]:
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for step in steps:
        ids, labels = (t.chunk(dp_size)[dp_rank] for t in own_models.batch(step))
        losses.append(float(model.run_train(ids, labels)))  # positionally, in the forward's (or input_names') order
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _own_snapshot(model, optimizer):
    from nxd_hf.checkpoint import full_optimizer_state

    params = nxd_hf.full_state_dict(model, rank0_only=True)
    state = full_optimizer_state(model, optimizer, rank0_only=True)
    return None if params is None else {**params, **{f"optim.{k}": v for k, v in state.items()}}


def check_own_model_checkpoint_across_layouts(path, parallel: bool, save: dict, load: dict) -> None:
    """save_checkpoint of a model that is not Hugging Face's at one layout, load_checkpoint into
    one built with other weights at another: the same weights and optimizer state, bit for bit,
    and the same losses on."""
    model, optimizer = _own_build(parallel, **save)
    _own_train(model, optimizer, range(2))
    saved = _own_snapshot(model, optimizer)
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=optimizer, user_content={"step": 2})
    expected = _own_train(model, optimizer, range(2, 4))
    model, optimizer = _own_build(parallel, seed=7, **load)
    assert nxd_hf.load_checkpoint(path, model=model, optimizer=optimizer) == {"step": 2}
    loaded = _own_snapshot(model, optimizer)
    if loaded is not None:
        assert saved.keys() == loaded.keys(), saved.keys() ^ loaded.keys()
        for name in saved:
            torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(_own_train(model, optimizer, range(2, 4))), torch.tensor(expected), **TOL)


OWN_CHECKPOINTS = {  # world 2
    "parallel_layers_tp2_to_pp2": dict(parallel=True, save=dict(tp=2), load=dict(pp=2)),
    "parallel_layers_pp2_to_dp2_zero1": dict(parallel=True, save=dict(pp=2), load=dict(zero1=True)),
    "plain_dp2_zero1_to_pp2": dict(parallel=False, save=dict(zero1=True), load=dict(pp=2)),
}


@pytest.mark.parametrize("layouts", list(OWN_CHECKPOINTS))
def test_own_model_checkpoint_across_layouts(ranks2, tmp_path, layouts):
    ranks2.run(check_own_model_checkpoint_across_layouts, str(tmp_path / layouts), **OWN_CHECKPOINTS[layouts])


def _own_bf16(parallel: bool):
    return own_models.build(parallel).to(torch.bfloat16)


def check_own_model_bf16_tracks_fp32() -> None:
    """A bf16 model built from parallel layers at tp=2: fp32 gradient accumulation and master
    weights as for HF models; within 2% of the fp32 one-process losses (bf16 rounding)."""
    parallel_state.destroy_model_parallel()
    ref_losses, _, _ = _own_reference(5)
    nxd_config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2,
                                                   optimizer_config={"max_grad_norm": MAX_NORM})
    model = nxd_hf.initialize_parallel_model(nxd_config, _own_bf16, True)
    optimizer = nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert model.dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for group in optimizer.masters for m in group.masters)
    losses = []
    for step in range(5):
        losses.append(model.run_train(*own_models.batch(step)).float())
        assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    relative = ((torch.stack(losses) - ref_losses) / ref_losses).abs()
    assert relative.max() < 0.02, relative


def test_own_model_bf16_tracks_fp32(ranks2):
    ranks2.run(check_own_model_bf16_tracks_fp32)


class _Tuple(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x), x  # no loss


def check_errors_name_the_fix() -> None:
    """The config API refuses what it cannot shard, and the pipeline's and run_train's generic
    errors say what to do."""
    def config(**kwargs):
        parallel_state.destroy_model_parallel()
        return nxd_hf.neuronx_distributed_config(**kwargs)

    with pytest.raises(ValueError, match=r"plain PyTorch module.*neuronx_distributed_config\(dummy_forward_args="):
        nxd_hf.initialize_parallel_model(config(tensor_parallel_size=2), own_models.build, False)
    with pytest.raises(ValueError, match="not a Hugging Face model .*set target_modules"):
        nxd_hf.initialize_parallel_model(config(lora_config=LoraConfig(enable_lora=True)),
                                         own_models.build, True)
    with pytest.raises(ValueError, match="activation_checkpoint_config=<YourLayer>"):
        nxd_hf.initialize_parallel_model(config(activation_checkpoint_config="full"), own_models.build, False)
    built = nxd_hf.initialize_parallel_model(config(), own_models.build, True)
    with pytest.raises(ValueError, match="already parallelized"):
        nxd_hf.initialize_parallel_model(config(), lambda: built.module)
    with pytest.raises(ValueError, match="return the scalar loss"):
        nxd_hf.initialize_parallel_model(config(), _Tuple).run_train(torch.ones(2, 4))
    ids, labels = own_models.batch(0)
    hf = nxd_hf.initialize_parallel_model(config(), _model_fn)
    with pytest.raises(ValueError, match="run_train needs labels"):
        hf.run_train(ids)
    hf_pp = nxd_hf.initialize_parallel_model(config(pipeline_parallel_size=2, pipeline_config={"num_microbatches": 2}),
                                             _model_fn)
    with pytest.raises(ValueError, match="need labels .* pass labels="):
        hf_pp.run_train(input_ids=ids)
    with pytest.raises(ValueError, match="NxDPPModel has no forward: call run_train"):
        hf_pp.module(input_ids=ids)
    own_pp = nxd_hf.initialize_parallel_model(config(pipeline_parallel_size=2, pipeline_config=own_models.PIPELINE),
                                              own_models.build, True)
    with pytest.raises(ValueError, match=r"got no \['labels'\].*output_loss_value_spec"):
        own_pp.run_train(input_ids=ids)


def test_errors_name_the_fix(ranks2):
    ranks2.run(check_errors_name_the_fix)


def test_dp2_zero1_matches_single_process(ranks2):
    ranks2.run(check_matches_single_process)


WORLD4_LAYOUTS = {
    "dp4_zero1": dict(tp=1, zero1=True),
    "tp2_dp2_zero1": dict(tp=2, zero1=True),
    "pp2_dp2_zero1": dict(pp=2, zero1=True),
    "dp4_zero1_accumulate2": dict(tp=1, zero1=True, accumulate=2),
    "tp2_dp2_plain_dp_reduction_accumulate2": dict(tp=2, zero1=False, accumulate=2),
}


@pytest.mark.parametrize("layout", list(WORLD4_LAYOUTS))
def test_config_api_matches_single_process(ranks4, layout):
    ranks4.run(check_matches_single_process, **WORLD4_LAYOUTS[layout])


def test_bf16_with_fp32_master_weights_tracks_fp32(ranks4):
    ranks4.run(check_bf16_tracks_fp32)


def test_sequential_move_factor_builds_one_rank_at_a_time(ranks4):
    ranks4.run(check_sequential_build)


def test_autocast_around_run_train_keeps_fp32_grads(ranks4):
    ranks4.run(check_autocast_around_run_train)


@pytest.mark.parametrize("kwargs,message", [
    (dict(optimizer_config={"zero_one": True}), "unknown optimizer_config key"),
    (dict(optimizer_config={"max_grad_norm": "1"}), "wrong type"),
    (dict(model_init_config={"sequential_move_factor": 0}), "1..32"),
    (dict(model_init_config={"meta_device_init": True}), "param_init_fn"),
    (dict(mixed_precision_config={"use_master_weights": "yes"}), "wrong type"),
    (dict(pipeline_parallel_size=1, pipeline_config={"num_microbatches": 2}), "pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, pipeline_config={"microbatches": 2}), "unknown pipeline_config key"),
    (dict(lora_config={"enable_lora": True}), "lora_config must be"),
    (dict(tensor_parallel_size=2.0), "wrong type"),
])
def test_config_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nxd_hf.neuronx_distributed_config(**kwargs)
