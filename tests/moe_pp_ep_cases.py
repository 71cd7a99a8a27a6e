"""Pipeline x expert parallelism (issue 24): MoE layers of each pipeline stage split their experts
over the expert group (EP carved from DP at the same (pp, tp) position), run on 4 ranks as pp=2 x
ep=2 (dp=2, one expert block) and compared with the unparallelized HF model on the same weights
and data: loss with HF's aux loss (padded mask), every gathered gradient, AdamW steps, gradient
accumulation; the all-to-alls of each expert group pair up; checkpoints reshard to pp1 x ep1;
NxDTrainer equals transformers.Trainer. Run by tests/distributed/test_moe_pp_ep.py."""

import torch
import transformers

import nxd_hf
from moe_pp_cases import TINY_MOE, WITH_AUX, VOCAB, build_pair
from nxd_hf import backend, parallel_state
from nxd_hf.parity import gathered_grad
from nxd_hf.parallel_layers.sharding import full_tensor

TOL = dict(rtol=1e-4, atol=1e-5)
LR = 1e-3
EP_TAGS = ("ep_counts", "ep_dispatch", "ep_dispatch_weights", "ep_combine")


def padded_batch(seed: int, b: int = 8, s: int = 8):
    """(ids, attention mask, labels): every other row left-padded by 1-3 tokens (masked out of the
    aux loss, labels ignored), a few more labels ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(1, b, 2):
        mask[row, : 1 + row % 3] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, -2:] = -100
    device = backend.default_device()
    return ids.to(device), mask.to(device), labels.to(device)


def replica_rows(*tensors):
    """This data-parallel replica's rows of each tensor (consecutive blocks)."""
    dp, rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    return [t.chunk(dp)[rank] for t in tensors]


def expert_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}


def parallelize_pp_ep(model, *, pp: int = 2, ep: int = 2, **pipeline_kwargs):
    """``model`` at pp x ep; its experts checked to be split (E / ep consecutive ones per rank)."""
    pipeline_kwargs.setdefault("broadcast_and_average_loss", True)
    model = nxd_hf.parallelize(model, pipeline_parallel_size=pp, expert_parallel_size=ep, **pipeline_kwargs)
    assert parallel_state.get_expert_parallel_size() == ep
    experts = expert_params(model)
    assert experts, "no expert-parallel parameter on this stage"
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
    expert_ranks = tuple(parallel_state.get_expert_parallel_group(as_list=True)[0])
    groups = [g for g in parallel_state.get_expert_parallel_group(as_list=True) if backend.rank() in g]
    expert_ranks = tuple(groups[0])
    assert mine and all(ranks == expert_ranks for _, _, ranks in mine), (mine[:3], expert_ranks)
    tags = {tag for _, tag, _ in mine}
    assert {"ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward"} <= tags, tags
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
                           schedule: str = "1f1b", activation_checkpoint_config=None) -> dict:
    """``steps`` AdamW steps at pp=2 x ep=2, each accumulated over ``accumulate`` run_train calls
    (no_sync, the step's token count given) of ``num_microbatches`` microbatches: every call's
    loss (with HF's aux loss of its batch), every gathered gradient and the final parameters equal
    the HF model's on the whole batches; the exchanges pair up in every expert group."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    model = parallelize_pp_ep(model, num_microbatches=num_microbatches, schedule=schedule,
                              activation_checkpoint_config=activation_checkpoint_config)
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
