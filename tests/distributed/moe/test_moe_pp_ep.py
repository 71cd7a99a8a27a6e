"""Pipeline x expert parallelism: pp=2 x ep=2 on 4 ranks against the unparallelized HF
model."""

import pytest
import torch
import transformers
from support.moe_pp import build_pair, replica_rows, VOCAB, WITH_AUX

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor
from support.moe_pp_ep import (
    check_exchanges_pair_up, compare_grads, expert_params, padded_batch, parallelize_pp_ep, TOL,
)


LR = 1e-3


def pipeline_ep_matches_hf(model_type: str, *, num_microbatches: int = 2, accumulate: int = 2, steps: int = 3,
                           schedule: str = "1f1b", activation_checkpoint_config=None, virtual_pipeline_size: int = 1,
                           **overrides) -> dict:
    """``steps`` AdamW steps at pp=2 x ep=2, each accumulated over ``accumulate`` run_train calls
    (no_sync, the step's token count given) of ``num_microbatches`` microbatches: every call's
    loss (with HF's aux loss of its batch), every gathered gradient and the final parameters equal
    the HF model's on the whole batches; the exchanges pair up in every expert group."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type, **overrides)
    model = parallelize_pp_ep(model, num_microbatches=num_microbatches, schedule=schedule,
                              activation_checkpoint_config=activation_checkpoint_config,
                              virtual_pipeline_size=virtual_pipeline_size)
    assert (model.router_aux is not None) == (model_type in WITH_AUX)
    # lr 1e-3: Adam's g / sqrt(v) turns a float-rounding difference in a near-zero gradient into a
    # difference of up to lr in the weight; at 1e-2 one weight in 512 moved 3e-5 apart after 3 steps
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    exchanges, aux = 0, []
    for step in range(steps):
        batches = [padded_batch(seed=100 * step + i) for i in range(accumulate)]
        total = sum((labels[..., 1:] != -100).sum() for _, _, labels in batches).float()
        for i, (ids, mask, labels) in enumerate(batches):
            out = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=total)
            out.loss.backward()
            if out.aux_loss is not None:
                aux.append(float(out.aux_loss.detach()))
            ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
            with backend.count_comm() as records:
                if i < accumulate - 1:
                    with model.no_sync():
                        loss = model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r,
                                               num_items_in_batch=total)
                else:
                    loss = model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r,
                                           num_items_in_batch=total)
            exchanges += check_exchanges_pair_up(records)
            torch.testing.assert_close(loss, out.loss.detach(), **TOL, msg=lambda m: f"step {step}.{i} loss: {m}")
        compare_grads(model, reference, f"{model_type} step {step}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    ids, mask, labels = padded_batch(seed=999)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
    torch.testing.assert_close(model.run_eval(input_ids=ids_r, attention_mask=mask_r, labels=labels_r), want, **TOL)
    return {"exchanges": exchanges, "aux": aux}


# -- checkpoints: pp2 x ep2 <-> pp1 x ep1 (the other ranks data parallel)
def _uniform_batch(step: int, b: int = 8, s: int = 8):
    """No padding and no ignored label: every data-parallel rank has as many tokens, so the mean of
    the replicas' losses (pp=1) is the token mean of the pipeline (pp=2)."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (b, s), generator=g).to(backend.default_device())
    return ids, torch.ones_like(ids), ids.clone()


def _build_layout(model_type: str, pp: int, ep: int):
    parallel_state.destroy_model_parallel()
    _, model = build_pair(model_type, aux=False)  # at pp=1 HF's aux loss would be each replica's
    if pp > 1:
        model = parallelize_pp_ep(model, pp=pp, ep=ep, num_microbatches=2)
    else:
        nxd_hf.parallelize(model, expert_parallel_size=ep)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _layout_steps(model, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, mask, labels = replica_rows(*_uniform_batch(step))
        if hasattr(model, "run_train"):
            loss = model.run_train(input_ids=ids, attention_mask=mask, labels=labels)
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = loss / parallel_state.get_data_parallel_size()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _reference_losses(model_type: str, steps: int) -> tuple[list[float], dict]:
    reference, _ = build_pair(model_type, aux=False)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, mask, labels = _uniform_batch(step)
        loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, reference


def checkpoint_reshards(model_type: str, path: str, *, save: tuple[int, int], load: tuple[int, int]) -> None:
    """Two AdamW steps at ``save`` = (pp, ep), save_checkpoint (experts stored as ``ep`` parts),
    rebuild at ``load``, load_checkpoint: the gathered model and optimizer state are the saved
    ones exactly; one more step equals the uninterrupted run's third step, and both the HF model's."""
    from nxd_hf.checkpoint import full_optimizer_state
    from nxd_hf.checkpoint.logical import DiskNames

    ref_losses, reference = _reference_losses(model_type, 3)
    model, optimizer = _build_layout(model_type, *save)
    losses = _layout_steps(model, optimizer, range(2))
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=optimizer)
    saved = nxd_hf.full_state_dict(model), full_optimizer_state(model, optimizer)
    uninterrupted = _layout_steps(model, optimizer, range(2, 3))
    after = nxd_hf.full_state_dict(model)
    model, optimizer = _build_layout(model_type, *load)
    nxd_hf.load_checkpoint(path, tag="step2", model=model, optimizer=optimizer)
    loaded = nxd_hf.full_state_dict(model), full_optimizer_state(model, optimizer)
    for a, b in zip(saved, loaded):
        assert set(a) == set(b) and a, set(a) ^ set(b)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    resumed = _layout_steps(model, optimizer, range(2, 3))
    torch.testing.assert_close(torch.tensor(losses + resumed), torch.tensor(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), **TOL)
    final = nxd_hf.full_state_dict(model)
    disk_name = DiskNames(reference)
    ref = {disk_name(n): t.detach() for n, t in reference.state_dict().items()}
    assert set(final) == set(after) == set(ref)
    for name in after:
        torch.testing.assert_close(final[name], after[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(final[name], ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# -- from_pretrained / save_pretrained at pp2 x ep2
def from_pretrained_reads_local_experts(model_type: str, path: str) -> None:
    """transformers' save_pretrained (per-expert names) -> nxd_hf.from_pretrained at pp2 x ep2:
    each rank reads only its stage's weights and of those only its experts; the logits equal HF's;
    nxd_hf.save_pretrained writes what transformers writes, which plain transformers loads with
    the same logits."""
    import os

    import safetensors.torch

    parallel_state.destroy_model_parallel()
    reference, _ = build_pair(model_type, aux=False)
    reference.eval()
    source, out = os.path.join(path, "hf"), os.path.join(path, "nxd")
    if backend.rank() == 0:
        reference.save_pretrained(source)
    backend.barrier()
    model = nxd_hf.from_pretrained(source, pipeline_parallel_size=2, expert_parallel_size=2, num_microbatches=2,
                                   broadcast_and_average_loss=True)
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.nxd.load_report.bytes_read == local, (model.nxd.load_report.bytes_read, local)
    stage = sum(p.numel() * p.element_size() for n, p in reference.named_parameters()
                if n in dict(model.named_parameters()))
    experts = expert_params(model)
    assert experts and all(p.shape[0] * 2 == p.expert_logical_size for p in experts.values())
    assert local < stage  # the other half of this stage's experts is not read
    ids, mask, labels = padded_batch(seed=7)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
    loss, logits = model.run_eval(input_ids=ids_r, attention_mask=mask_r, labels=labels_r, return_logits=True)
    torch.testing.assert_close(loss, expected.loss, **TOL)
    torch.testing.assert_close(logits, replica_rows(expected.logits)[0], **TOL)
    nxd_hf.save_pretrained(model, out)
    if backend.rank() == 0:
        def keys(directory):
            return {k for f in os.listdir(directory) if f.endswith(".safetensors")
                    for k in safetensors.torch.load_file(os.path.join(directory, f))}
        assert keys(out) == keys(source), sorted(keys(out) ^ keys(source))[:4]
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, expected.logits, **TOL)
    backend.barrier()


# -- NxDTrainer at pp2 x ep2 with the aux loss against transformers.Trainer
def trainer_matches_hf(model_type: str, out_dir: str, *, accumulate: int = 2, zero_1: bool = False) -> None:
    """NxDTrainer at pp=2 x ep=2 (dp=2, 2 microbatches, gradient accumulation, AdamW, clipping,
    warmup) logs the losses (HF's aux loss in them) and grad norms of transformers.Trainer on the
    whole model and ends with its weights. ``zero_1``: with ZeRO-1 (expert states over expert_data)."""
    from support.moe_pp import TRAINER_COMMON, trainer_dataset

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    data = trainer_dataset()
    dp = backend.world_size() // 2
    ref = transformers.Trainer(reference, transformers.TrainingArguments(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=4 * dp, gradient_accumulation_steps=accumulate,
        **TRAINER_COMMON), train_dataset=data)
    ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4,
                                       gradient_accumulation_steps=accumulate, pipeline_parallel_size=2,
                                       num_microbatches=2, expert_parallel_size=2, zero_1=zero_1, **TRAINER_COMMON)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data)
    ours.train()
    assert parallel_state.get_expert_parallel_size() == 2 and expert_params(ours.nxd_model)
    assert ours.nxd_model.module.router_aux is not None  # the NxDPPModel inside
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in ref.state.log_history if key in h]
        assert len(got) == len(want) == TRAINER_COMMON["max_steps"], (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m, k=key: f"{k}: {m}")
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")


# -- bad input
def refusals() -> None:
    """Layouts pp x ep cannot run are one ValueError naming the fix, on every rank."""
    import pytest

    cases = [
        (dict(num_local_experts=6), dict(expert_parallel_size=4), "must divide the data-parallel size"),
        (dict(num_local_experts=3), dict(expert_parallel_size=2), "3 experts, not divisible by expert_parallel_size=2"),
    ]
    for overrides, kwargs, message in cases:
        parallel_state.destroy_model_parallel()
        _, model = build_pair("mixtral", **overrides)
        with pytest.raises(ValueError, match=message):
            nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2, **kwargs)
    parallel_state.destroy_model_parallel()
    _, model = build_pair("mixtral")
    other = 4 if backend.rank() == 3 else 2  # rank 3's expert peer (rank 2) would pair its all-to-alls wrongly
    with pytest.raises(ValueError, match=r"different schedules on different ranks \(num_microbatches: rank 0: 2, "
                                         r"rank 1: 2, rank 2: 2, rank 3: 4\)"):
        nxd_hf.parallelize(model, pipeline_parallel_size=2, expert_parallel_size=2, num_microbatches=other)
    parallel_state.destroy_model_parallel()


def sweep_case(model_type: str) -> tuple[str, str]:
    """``check_parity``'s case (``nxd_hf.parity.run_case``) at pp=2 x ep=2 on the sweep's tiny config."""
    from bench.architectures.run import tiny_config
    from nxd_hf.parity.cases import run_case

    case = run_case(tiny_config(model_type), tensor_parallel_size=1, pipeline_parallel_size=2, expert_parallel_size=2)
    return case.status, case.message


def failing_expert_rank(failing_rank: int) -> tuple[str, float]:
    """A step in which one rank's experts raise (its expert-group peer then waits in an all-to-all):
    (the error every rank gets, seconds until it came)."""
    import time

    parallel_state.destroy_model_parallel()
    _, model = build_pair("mixtral", aux=False)
    model = parallelize_pp_ep(model, num_microbatches=2)
    ids, mask, labels = replica_rows(*padded_batch(seed=1))
    model.run_train(input_ids=ids, attention_mask=mask, labels=labels)  # a good step first

    def hook(module, args, output):
        raise RuntimeError(f"experts failed on purpose on rank {failing_rank}")

    if backend.rank() == failing_rank:
        next(m for n, m in model.local_named_modules() if n.endswith("mlp.experts")).register_forward_hook(hook)
    start = time.monotonic()
    try:
        model.run_train(input_ids=ids, attention_mask=mask, labels=labels)
    except ValueError as error:
        return str(error), time.monotonic() - start
    raise AssertionError(f"rank {backend.rank()}: the step did not fail")


def _run_parity(ranks4, model_type, **kwargs):
    results = ranks4.run(pipeline_ep_matches_hf, model_type, **kwargs)
    assert all(r["exchanges"] > 0 for r in results), [r["exchanges"] for r in results]  # every stage has experts
    assert (len(results[0]["aux"]) > 0) == (model_type != "deepseek_v3")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_pp2_ep2_matches_hf(ranks4, model_type):
    _run_parity(ranks4, model_type)


@pytest.mark.parametrize("schedule,vpp,microbatches", [("gpipe", 1, 4), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2),
                                                          ("interleaved_zero_bubble", 2, 2)])
def test_pp2_ep2_schedules(ranks4, schedule, vpp, microbatches):
    _run_parity(ranks4, "mixtral", schedule=schedule, virtual_pipeline_size=vpp, num_microbatches=microbatches,
                accumulate=1, steps=2)


def test_pp2_ep2_activation_checkpointing(ranks4):
    _run_parity(ranks4, "qwen3_moe", activation_checkpoint_config="full", accumulate=1, steps=2)


def test_pp2_ep2_stage_without_experts(ranks4):
    """Layers 0-1 dense (stage 0 holds no experts and makes no exchange), layers 2-3 routed."""
    results = ranks4.run(pipeline_ep_matches_hf, "qwen3_moe", mlp_only_layers=[0, 1], accumulate=1, steps=2)
    assert [r["exchanges"] > 0 for r in results] == [False, False, True, True], results


@pytest.mark.parametrize("save,load", [((2, 2), (1, 1)), ((1, 1), (2, 2))], ids=["pp2ep2_to_pp1ep1", "pp1ep1_to_pp2ep2"])
def test_checkpoint_reshards_pp2_ep2(ranks4, tmp_path, save, load):
    ranks4.run(checkpoint_reshards, "qwen3_moe", str(tmp_path / "ckpt"), save=save, load=load)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_from_pretrained_at_pp2_ep2_reads_local_experts(ranks4, tmp_path, model_type):
    ranks4.run(from_pretrained_reads_local_experts, model_type, str(tmp_path))


@pytest.mark.parametrize("zero_1", [False, True], ids=["adamw", "zero1"])
def test_nxd_trainer_pp2_ep2_matches_trainer(ranks4, tmp_path, zero_1):
    ranks4.run(trainer_matches_hf, "mixtral", str(tmp_path), zero_1=zero_1)


def test_refusals_pp2(ranks4):
    ranks4.run(refusals)


def test_pp2_ep2_dp4_expert_data_reduction(ranks8):
    """World 8: pp=2 x dp=4 with two expert blocks per stage, so the experts' gradients are averaged
    over an expert_data group of 2 (the ranks holding the same experts)."""
    results = ranks8.run(pipeline_ep_matches_hf, "qwen3_moe", accumulate=1, steps=2)
    assert all(r["exchanges"] > 0 for r in results)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_check_parity_case_at_pp2_ep2(ranks4, model_type):
    status, message = ranks4.run(sweep_case, model_type)[0]
    assert status == "pass", message


@pytest.mark.parametrize("failing_rank", [1, 2])  # the first stage's second expert rank; the last stage's first
def test_one_expert_rank_failing_fails_every_rank(no_rank_pool, failing_rank):
    """Its expert-group peer, blocked in an all-to-all, and the other stage get the same ValueError
    at once (the groups are aborted, so fresh processes)."""
    from nxd_hf.testing import run_distributed

    results = run_distributed(failing_expert_rank, 4, failing_rank, timeout_s=120)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(f"run_train failed on rank {failing_rank} "), message
    assert f"experts failed on purpose on rank {failing_rank}" in message, message
    assert max(elapsed for _, elapsed in results) < 10, results
