"""Pipeline x expert parallelism: MoE layers of each pipeline stage split their experts
over the expert group (EP carved from DP at the same (pp, tp) position), run on 4 ranks as pp=2 x
ep=2 (dp=2, one expert block) and compared with the unparallelized HF model on the same weights
and data: loss with HF's aux loss (padded mask), every gathered gradient, AdamW steps, gradient
accumulation; the all-to-alls of each expert group pair up; checkpoints reshard to pp1 x ep1;
NxDTrainer equals transformers.Trainer. Run by tests/distributed/test_moe_pp_ep.py."""

import torch
import transformers

import nxd_hf
from moe_pp_cases import WITH_AUX, VOCAB, build_pair, moe_batch, replica_rows
from nxd_hf import backend, parallel_state
from nxd_hf.parity import gathered_grad
from nxd_hf.parallel_layers.sharding import full_tensor

TOL = dict(rtol=1e-4, atol=1e-5)
LR = 1e-3
EP_TAGS = ("ep_counts", "ep_dispatch", "ep_dispatch_weights", "ep_combine")


def padded_batch(seed: int, b: int = 8, s: int = 8):
    """(ids, attention mask, labels): ``moe_batch``'s (row 1 left-padded by 3), and every other row
    after it left-padded by 1-3 tokens too (masked out of the aux loss, labels ignored)."""
    ids, mask, labels = moe_batch(seed=seed, b=b, s=s)
    for row in range(3, b, 2):
        mask[row, : 1 + row % 3] = 0
    labels[mask == 0] = -100
    return ids, mask, labels


def expert_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}


def parallelize_pp_ep(model, *, pp: int = 2, ep: int = 2, **pipeline_kwargs):
    """``model`` at pp x ep; its experts checked to be split (E / ep consecutive ones per rank)."""
    pipeline_kwargs.setdefault("broadcast_and_average_loss", True)
    model = nxd_hf.parallelize(model, pipeline_parallel_size=pp, expert_parallel_size=ep, **pipeline_kwargs)
    assert parallel_state.get_expert_parallel_size() == ep
    assert parallel_state.get_expert_data_parallel_size() == parallel_state.get_data_parallel_size() // ep
    experts = expert_params(model)
    rank = parallel_state.get_expert_parallel_rank()
    for name, param in experts.items():
        local = param.expert_logical_size // ep
        assert param.shape[0] == local and param.expert_shard_index.tolist() == list(
            range(rank * local, (rank + 1) * local)), name
    return model


def _check_exchanges_pair_up(records) -> int:
    """The all-to-alls (and count exchanges) of this rank and of its expert-group peers are the
    same sequence on the same group (so each pairs with its peers'); returns how many."""
    mine = [(r.op, r.tag, r.ranks) for r in records if r.tag.split(".")[0] in EP_TAGS]
    expert_ranks = next(tuple(g) for g in parallel_state.get_expert_parallel_group(as_list=True) if backend.rank() in g)
    assert all(ranks == expert_ranks for _, _, ranks in mine), (mine[:3], expert_ranks)
    tags = {tag for _, tag, _ in mine}
    assert not mine or {"ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward"} <= tags, tags
    everyone = [None] * backend.world_size()
    torch.distributed.all_gather_object(everyone, [(op, tag) for op, tag, _ in mine])
    for peer in expert_ranks:
        assert everyone[peer] == everyone[backend.rank()], f"rank {backend.rank()} and rank {peer} differ"
    return len(mine)


def _compare_grads(model, reference, label: str) -> int:
    ref = dict(reference.named_parameters())
    count = 0
    for name, param in model.named_parameters():
        want = ref[name].grad if ref[name].grad is not None else torch.zeros_like(ref[name])
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(gathered_grad(param, grad), want, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")
        count += 1
    assert count > 0
    return count


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
            exchanges += _check_exchanges_pair_up(records)
            torch.testing.assert_close(loss, out.loss.detach(), **TOL, msg=lambda m: f"step {step}.{i} loss: {m}")
        _compare_grads(model, reference, f"{model_type} step {step}")
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
    from moe_pp_cases import TRAINER_COMMON, trainer_dataset

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
