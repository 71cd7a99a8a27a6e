"""ZeRO-3 / ZeRO-2 (FSDP2) on mixture-of-experts models: the experts sharded over the expert-data
group, the rest over DP. AdamW steps with active clipping against the one-process HF model (loss,
norm, every gathered gradient, the parameters) at ep=2 x dp=4 (also a rank whose experts get no
token), HSDP with ep (world 4: the experts replicated; world 8: sharded 2 x 2), pp=2 x ep=2 (world
4 and 8); ZeRO-3 MoE checkpoints (also HSDP) loaded at ep=2 ZeRO-1 and ep=1 ZeRO-3. The ranks4 cases
come first, then the ranks8 ones: one pool of each size."""

import pytest
import torch
import transformers

from support import moe
from support.fsdp import LR, MAX_NORM, STEPS, assert_same_states, check_params, check_step_and_step, full_states
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.fsdp import is_dp_sharded
from nxd_hf.parallel_layers.grads import clip_grad_norm


def check_expert_parallel_fsdp_matches_hf(model_type: str, mode: str, starve: bool = False,
                                         shard_size: int | None = None) -> None:
    """ep=2 x dp=4 on a MoE model: the experts sharded over the expert-data group (2 ranks), the
    rest over DP (4); AdamW steps with clipping against the one-process model (loss, norm, every
    gathered gradient, the parameters). ``starve``: one rank's experts get no token (their zero
    gradients still join FSDP2's reduce-scatter). ``shard_size``: HSDP, the rest sharded over blocks
    of that many DP ranks, the experts over the expert-data ranks inside the block (shard_size / 2,
    at least one), both replicated across the blocks."""
    from support import moe_ep

    parallel_state.destroy_model_parallel()
    reference, model = moe_ep.build_pair(model_type)
    for m in (reference, model) if starve else ():
        moe.route_to_first_experts(m, moe_ep.config(model_type).num_experts // 2)
        m.config._experts_implementation = "eager"  # a loop over the experts hit: the others get no gradient
    nxd_hf.parallelize(model, expert_parallel_size=2, data_parallel_sharding=mode, data_parallel_shard_size=shard_size)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    experts = moe_ep.expert_params(model)
    assert experts and all(is_dp_sharded(p) for p in model.parameters())
    edp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()))
    edp, experts_shard = len(edp_ranks), max((shard_size or dp) // 2, 1)
    hybrid = dict(dense=(dp // shard_size, shard_size), experts=(edp // experts_shard, experts_shard)
                  ) if shard_size else dict(dense=(dp,), experts=(edp,))
    for name, param in model.named_parameters():
        mesh, kind = param.device_mesh, "experts" if name in experts else "dense"
        assert tuple(sorted(mesh.mesh.flatten().tolist())) == (edp_ranks if name in experts else tuple(range(dp))), name
        assert tuple(mesh.shape) == hybrid[kind], (name, mesh)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        ids, labels = moe_ep.global_batch(step, dp)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ids, labels = moe_ep.rank_batch(step, dp_rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
        loss = loss.detach()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        # every rank has as many labels: the mean of the ranks' means is the whole batch's
        check_step_and_step(f"ep2 {mode} step {step}", model, reference, (ref_optimizer, optimizer),
                             loss=loss / dp, ref_loss=ref_loss.detach(), norm=norm, ref_norm=ref_norm)
    check_params(f"ep2 {mode}", model, reference)


def check_pipeline_expert_fsdp_matches_hf(mode: str) -> None:
    """pp=2 x ep=2 on a Qwen3-MoE with HF's aux loss (world 4: dp=2 per stage, the expert-data group
    one rank; world 8: dp=4, expert-data 2): each stage its own FSDP root, the dense parts sharded
    over DP, the experts over the expert-data group; AdamW steps with clipping against the
    one-process model (loss, norm, every gathered gradient, the parameters)."""
    from support.moe_pp import build_pair as moe_pp_pair, replica_rows
    from support.moe_pp_ep import expert_params, padded_batch, parallelize_pp_ep

    parallel_state.destroy_model_parallel()
    reference, model = moe_pp_pair("qwen3_moe")
    pp_model = parallelize_pp_ep(model, num_microbatches=2, data_parallel_sharding=mode)
    assert all(is_dp_sharded(p) for p in pp_model.parameters())
    experts, dp = expert_params(pp_model), parallel_state.get_data_parallel_size()
    edp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()))
    dp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    assert experts and dp == torch.distributed.get_world_size() // 2
    for name, param in pp_model.named_parameters():
        ranks = tuple(torch.distributed.get_process_group_ranks(param.device_mesh.get_group(0)))
        assert ranks == (edp_ranks if name in experts else dp_ranks), name
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    optimizer = torch.optim.AdamW(pp_model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        ids, mask, labels = padded_batch(seed=100 + step)
        total = (labels[..., 1:] != -100).sum()
        out = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=total)
        out.loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
        loss = pp_model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r, num_items_in_batch=total)
        norm = clip_grad_norm(pp_model.parameters(), MAX_NORM)
        check_step_and_step(f"pp2 ep2 {mode} step {step}", pp_model, reference, (ref_optimizer, optimizer),
                             loss=loss, ref_loss=out.loss.detach(), norm=norm, ref_norm=ref_norm)
    check_params(f"pp2 ep2 {mode}", pp_model, reference)


def _build_moe(ep: int, zero3: bool, shard_size: int | None = None):
    from support import moe_ep
    from nxd_hf.optim import NeuronZero1Optimizer

    parallel_state.destroy_model_parallel()
    _, model = moe_ep.build_pair("qwen3_moe")
    nxd_hf.parallelize(model, expert_parallel_size=ep, data_parallel_sharding="zero3" if zero3 else None,
                       data_parallel_shard_size=shard_size)
    if zero3:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clipping=False, lr=1e-2)


def check_expert_parallel_zero3_checkpoint(tmp_dir: str, shard_size: int | None = None) -> None:
    """Two AdamW steps of a MoE at ep=2 x dp=4 ZeRO-3 (experts over the expert-data group),
    ``save_checkpoint``; loaded at ep=2 ZeRO-1 (no FSDP) and at ep=1 x dp=4 ZeRO-3: the gathered
    parameters and AdamW state exactly; ``save_pretrained``'s directory opens in plain transformers
    with the trained parameters. ``shard_size``: saved under HSDP (the experts replicated
    across the shard blocks: only their first copy writes)."""
    from support import moe_ep

    model, optimizer = _build_moe(2, zero3=True, shard_size=shard_size)
    dp_rank = parallel_state.get_data_parallel_rank()
    for step in range(2):
        ids, labels = moe_ep.rank_batch(step, dp_rank)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    nxd_hf.save_checkpoint(tmp_dir, "ep2", model=model, optimizer=optimizer)
    saved = full_states(model, optimizer)
    model.save_pretrained(f"{tmp_dir}/hf")
    if torch.distributed.get_rank() == 0:  # the writer: plain transformers opens the trained model
        plain = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_dir}/hf").state_dict()
        assert plain.keys() == saved[0].keys(), sorted(plain.keys() ^ saved[0].keys())[:4]
        for name, tensor in plain.items():
            torch.testing.assert_close(tensor, saved[0][name], rtol=0, atol=0, msg=lambda m: f"transformers {name}: {m}")
    for ep, zero3 in ((2, False), (1, True)):
        model, optimizer = _build_moe(ep, zero3)
        nxd_hf.load_checkpoint(tmp_dir, "ep2", model=model, optimizer=optimizer)
        assert_same_states(saved, full_states(model, optimizer), f"ep={ep} {'zero3' if zero3 else 'zero1'}")


@pytest.mark.parametrize("model_type,mode", [("qwen3_moe", "zero3"), ("mixtral", "zero2")])
def test_fsdp_matches_hf_ep2_dp4_experts_over_expert_data(ranks4, model_type, mode):
    ranks4.run(check_expert_parallel_fsdp_matches_hf, model_type, mode)


def test_hybrid_zero3_matches_hf_ep2_dp4_shard2(ranks4):
    """HSDP with expert parallelism at world 4: the dense parts 2 x 2, the experts 2 copies of one
    shard (the block of 2 DP ranks holds one rank of each expert-data group)."""
    ranks4.run(check_expert_parallel_fsdp_matches_hf, "qwen3_moe", "zero3", shard_size=2)


def test_fsdp_matches_hf_ep2_dp4_rank_without_tokens(ranks4):
    ranks4.run(check_expert_parallel_fsdp_matches_hf, "qwen3_moe", "zero3", starve=True)


def test_fsdp_matches_hf_pp2_ep2_dp2(ranks4):
    ranks4.run(check_pipeline_expert_fsdp_matches_hf, "zero3")


def test_ep2_dp4_zero3_checkpoint_loads_at_ep2_zero1_and_ep1_zero3(ranks4, tmp_path):
    ranks4.run(check_expert_parallel_zero3_checkpoint, str(tmp_path))


def test_ep2_dp4_hybrid_zero3_checkpoint_loads_at_ep2_zero1_and_ep1_zero3(ranks4, tmp_path):
    ranks4.run(check_expert_parallel_zero3_checkpoint, str(tmp_path), shard_size=2)


# world 8: the experts' own shards are more than one rank (expert-data group of 2)
def test_hybrid_zero3_matches_hf_ep2_dp8_shard4(ranks8):
    """The dense parts 2 copies of 4 shards, the experts 2 copies of 2 shards."""
    ranks8.run(check_expert_parallel_fsdp_matches_hf, "qwen3_moe", "zero3", shard_size=4)


def test_fsdp_matches_hf_pp2_ep2_dp4(ranks8):
    ranks8.run(check_pipeline_expert_fsdp_matches_hf, "zero3")


def test_ep2_dp8_hybrid_zero3_checkpoint_loads_at_ep2_zero1_and_ep1_zero3(ranks8, tmp_path):
    """The experts 2 copies of 2 shards: the scalar state written by the expert-data group's first rank only."""
    ranks8.run(check_expert_parallel_zero3_checkpoint, str(tmp_path), shard_size=4)
