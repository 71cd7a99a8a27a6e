"""Pipeline x expert parallelism pieces shared by test_moe_pp_ep.py and the Llama 4 test: build a
pp x ep model, pad a batch, compare gathered gradients, check that each expert group's all-to-alls
pair up."""

import torch
from support.moe_pp import moe_batch

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parity import gathered_grad


TOL = dict(rtol=1e-4, atol=1e-5)
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


def check_exchanges_pair_up(records) -> int:
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


def compare_grads(model, reference, label: str) -> int:
    ref = dict(reference.named_parameters())
    count = 0
    for name, param in model.named_parameters():
        want = ref[name].grad if ref[name].grad is not None else torch.zeros_like(ref[name])
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(gathered_grad(param, grad), want, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")
        count += 1
    assert count > 0
    return count
