"""ZeRO-1 with expert parallelism: expert parameters sharded over the expert-data group,
the rest over the data group, exact against single-process HF + torch AdamW with clipping. Run on
the rank pools by tests/distributed/test_moe_zero1.py."""

import torch

from moe_ep_cases import TOL, build_pair, expert_params, global_batch, rank_batch

STEPS = 3
LR = 1e-3  # parameters compared after Adam steps: at lr 1e-3 a rounding-noise gradient moves its element ~1e-6
MAX_NORM = 0.05  # below the tiny models' gradient norms: clipping acts every step


def param_groups(model) -> list[dict]:
    """A decay / no-decay split (the expert tensors land in the decay group)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]


def _parallel(model, ep: int, config_api: bool):
    """(model, ZeRO-1 AdamW, loss of one rank batch) through ``parallelize`` or the config API."""
    import nxd_hf
    from nxd_hf.optim import NeuronZero1Optimizer

    if not config_api:
        nxd_hf.parallelize(model, expert_parallel_size=ep)
        optimizer = NeuronZero1Optimizer(param_groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM,
                                         bucket_size_mb=0.001)  # several buckets per flat group
        return model, optimizer, lambda ids, labels: _backward(model(input_ids=ids, labels=labels).loss)
    config = nxd_hf.neuronx_distributed_config(
        expert_parallel_size=ep, optimizer_config={"zero_one_enabled": True, "max_grad_norm": MAX_NORM})
    nxd_model = nxd_hf.initialize_parallel_model(config, lambda: model)
    optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, param_groups(nxd_model), lr=LR)
    assert isinstance(optimizer, NeuronZero1Optimizer)
    return nxd_model, optimizer, lambda ids, labels: nxd_model.run_train(input_ids=ids, labels=labels)


def _backward(loss: torch.Tensor) -> torch.Tensor:
    from nxd_hf import backend, parallel_state

    loss.backward()
    mean = loss.detach() / parallel_state.get_data_parallel_size()
    backend.all_reduce(mean, parallel_state.get_data_parallel_group())
    return mean


def assert_step_matches(model, optimizer, ref_params: dict, loss, ref_loss, ref_norm, step: int) -> None:
    """After a ZeRO-1 step: the DP-mean loss, the clipped grad norm (clipping acted) and every
    gathered parameter equal the reference's."""
    from nxd_hf.parallel_layers.sharding import full_tensor

    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert ref_norm > MAX_NORM
    torch.testing.assert_close(optimizer.grad_norm, ref_norm, **TOL, msg=lambda m: f"step {step} norm: {m}")
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"step {step} {name}: {m}")


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
