"""ZeRO-1 with expert parallelism: expert parameters' gradients, optimizer state and
master slices sharded over the expert-data group, the rest over the data group; exact against
single-process HF with AdamW and clipping."""

import pytest
import torch
from support.moe_ep import (
    build_pair, check_checkpoint_reshard, check_trainer_matches, expert_params, global_batch, rank_batch,
)

from support.moe_zero1 import zero1_backward, assert_step_matches, LR, MAX_NORM, param_groups


STEPS = 3


def _parallel(model, ep: int, config_api: bool):
    """(model, ZeRO-1 AdamW, loss of one rank batch) through ``parallelize`` or the config API."""
    import nxd_hf
    from nxd_hf.optim import NeuronZero1Optimizer

    if not config_api:
        nxd_hf.parallelize(model, expert_parallel_size=ep)
        optimizer = NeuronZero1Optimizer(param_groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM,
                                         bucket_size_mb=0.001)  # several buckets per flat group
        return model, optimizer, lambda ids, labels: zero1_backward(model(input_ids=ids, labels=labels).loss)
    config = nxd_hf.neuronx_distributed_config(
        expert_parallel_size=ep, optimizer_config={"zero_one_enabled": True, "max_grad_norm": MAX_NORM})
    nxd_model = nxd_hf.initialize_parallel_model(config, lambda: model)
    optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, param_groups(nxd_model), lr=LR)
    assert isinstance(optimizer, NeuronZero1Optimizer)
    return nxd_model, optimizer, lambda ids, labels: nxd_model.run_train(input_ids=ids, labels=labels)


def check_zero1_ep_training(model_type: str, ep: int, config_api: bool = False) -> None:
    """Losses, clipped grad norms and parameters over ``STEPS`` AdamW steps with ZeRO-1 at ``ep``
    (DP = world) equal single-process HF + AdamW + clip_grad_norm_ on the concatenated batches; the
    expert parameters' state is sharded over expert_data, the rest over data."""
    from nxd_hf import backend, parallel_state
    from nxd_hf.parallel_layers.sharding import is_expert_parallel

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    model, optimizer, train_step = _parallel(model, ep, config_api)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    edp = parallel_state.get_expert_data_parallel_size()
    assert parallel_state.get_expert_parallel_size() == ep and edp == dp // ep
    experts = [fg for fg in optimizer.flat_groups if is_expert_parallel(fg.params[0])]
    dense = [fg for fg in optimizer.flat_groups if not is_expert_parallel(fg.params[0])]
    assert experts and all(fg.dp_size == edp for fg in experts) and all(fg.dp_size == dp for fg in dense)
    local_experts = sum(p.numel() for p in expert_params(model).values())
    assert sum(fg.shard_numel for fg in experts) == sum(-(-fg.numel // edp) for fg in experts)
    assert sum(fg.numel for fg in experts) == local_experts
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=LR)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        ids, labels = global_batch(step, dp)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        ids, labels = rank_batch(step, dp_rank)
        with backend.count_comm() as records:
            loss = train_step(ids, labels)
            optimizer.step()
        optimizer.zero_grad()
        groups = {r.group_size for r in records if r.op == "reduce_scatter"}
        assert groups == ({dp, edp} if edp > 1 else {dp}), groups
        assert_step_matches(model, optimizer, ref_params, loss, ref_loss, ref_norm, step)


@pytest.mark.parametrize("world", [2, 4], ids=["world2", "dp4"])  # dp4: the experts' state split over 2 ranks
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_zero1_ep2_matches_hf(request, model_type, world):
    request.getfixturevalue(f"ranks{world}").run(check_zero1_ep_training, model_type, 2)


def test_zero1_ep2_through_the_config_api(ranks2):
    ranks2.run(check_zero1_ep_training, "qwen3_moe", 2, True)


RESHARDS = [((2, True), (1, True)), ((2, True), (1, False)), ((1, False), (2, True)), ((1, True), (2, True))]


@pytest.mark.parametrize("save,load", RESHARDS, ids=lambda layout: f"ep{layout[0]}{'_zero1' if layout[1] else ''}")
def test_zero1_checkpoint_reshards_across_ep_world2(ranks2, tmp_path, save, load):
    ranks2.run(check_checkpoint_reshard, "mixtral", str(tmp_path / "ckpt"), save[0], load[0], save[1], load[1])


@pytest.mark.parametrize("save,load", RESHARDS[:3], ids=lambda layout: f"ep{layout[0]}{'_zero1' if layout[1] else ''}")
def test_zero1_checkpoint_reshards_ep2_dp4_world4(ranks4, tmp_path, save, load):
    ranks4.run(check_checkpoint_reshard, "qwen3_moe", str(tmp_path / "ckpt"), save[0], load[0], save[1], load[1])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nxd_trainer_zero1_at_ep2_matches_trainer(ranks2, tmp_path, accumulate):
    ranks2.run(check_trainer_matches, "mixtral", str(tmp_path), 2, accumulate, True)


@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (1, 2)])
def test_zero1_sharded_state_files_reshard_across_ep_dp4(ranks4, tmp_path, save_ep, load_ep):
    """NxD's optimizer-only save_sharded_state_dict / load_sharded_state_dict with expert parameters."""
    ranks4.run(check_checkpoint_reshard, "mixtral", str(tmp_path / "ckpt"), save_ep, load_ep, True, True, True)
