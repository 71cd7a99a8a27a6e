"""The MoE load-balancing (aux) loss of the global batch at pipeline_parallel_size=1 with data and
expert parallelism (``nxd_hf.moe.replica_aux``): exact against the single-process
HF model and NxDTrainer against transformers.Trainer."""

from support import moe_pp
import pytest
import torch
from support.moe_ep import check_trainer_matches
from support.moe_pp import AUX_COEF, build_pair, moe_batch, TOL


STEPS = 3


def _global_batch(step: int, dp: int):
    """(ids, mask, labels) of ``2 x dp`` rows: row 1 left-padded (so replica 0 has fewer tokens)."""
    return moe_batch(seed=40 + step, b=2 * dp)


def check_global_aux_loss(model_type: str, ep: int = 1, accumulate: int = 1, tp: int = 1) -> None:
    """Over ``STEPS`` SGD steps at pp=1, dp = world, ``ep``: the DP mean of the loss, every rank's
    ``aux_loss``, every gathered gradient (routers included) and the parameters equal the
    single-process HF model's on the global batch. ``accumulate``: micro-steps per step, each
    adding the aux loss of its global micro-batch (as transformers.Trainer on one process); ``tp``:
    experts and attention sharded over TP too (dp = world / tp)."""
    import nxd_hf
    from nxd_hf import backend, parallel_state
    from nxd_hf.parallel_layers.loss_functions import loss_normalizer
    from nxd_hf.parallel_layers.sharding import full_tensor
    from nxd_hf.parity import gathered_grad

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    assert model.config.output_router_logits and model.router_aux_loss_coef == AUX_COEF
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    routers = [n for n in ref_params if n.endswith("mlp.gate.weight")]
    assert routers, list(ref_params)
    for step in range(STEPS):
        batches = [_global_batch(accumulate * step + micro, dp) for micro in range(accumulate)]
        tokens = sum((labels[:, 1:] != -100).sum() for _, _, labels in batches)
        for ids, mask, labels in batches:
            ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=tokens)
            ref_out.loss.backward()
            local = [t.chunk(dp)[dp_rank] for t in (ids, mask, labels)]
            out = model(input_ids=local[0], attention_mask=local[1], labels=local[2],
                        num_items_in_batch=loss_normalizer(local[2], tokens))
            out.loss.backward()
            mean = out.loss.detach() / dp
            backend.all_reduce(mean, parallel_state.get_data_parallel_group())
            torch.testing.assert_close(mean, ref_out.loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
            torch.testing.assert_close(out.aux_loss.detach(), ref_out.aux_loss.detach(), **TOL,
                                       msg=lambda m: f"step {step} aux loss: {m}")
        grads = {name: gathered_grad(param) for name, param in model.named_parameters()}
        torch.testing.assert_close(grads, {name: ref_params[name].grad for name in grads}, **TOL)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    final = {name: full_tensor(param) for name, param in model.named_parameters()}
    torch.testing.assert_close(final, {name: ref_params[name].detach() for name in final}, **TOL)


def check_hook_scope() -> None:
    """Evaluation forwards run no collective (rank 0 alone evaluates); a model whose aux loss is not
    HF's load_balancing_loss_func keeps its own, with a warning, on every rank."""
    import pytest
    import transformers

    import nxd_hf
    from nxd_hf import backend, parallel_state

    parallel_state.destroy_model_parallel()
    reference, model = build_pair("mixtral")
    nxd_hf.parallelize(model)
    ids, mask, labels = moe_batch(seed=5)
    if backend.rank() == 0:
        model.eval()
        with backend.count_comm() as records, torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, labels=labels).aux_loss
        assert not records, records
        with torch.no_grad():
            want = reference(input_ids=ids, attention_mask=mask, labels=labels).aux_loss
        torch.testing.assert_close(got, want, **TOL)
    torch.distributed.barrier()

    class OtherAux(transformers.MixtralForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.aux_loss = out.aux_loss * (1 + backend.rank())  # another formula on rank 1 only
            return out

    parallel_state.destroy_model_parallel()
    other = OtherAux(reference.config)
    other.load_state_dict(reference.state_dict())
    nxd_hf.parallelize(other)
    rows = [t.chunk(2)[backend.rank()] for t in (ids, mask, labels)]
    with pytest.warns(UserWarning, match="not HF's load_balancing_loss_func"):
        out = other(input_ids=rows[0], attention_mask=rows[1], labels=rows[2])
    with torch.no_grad():
        local = reference(input_ids=rows[0], attention_mask=rows[1], labels=rows[2]).aux_loss
    torch.testing.assert_close(out.aux_loss, local * (1 + backend.rank()), **TOL)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "ep2"])
def test_global_aux_loss_world2(ranks2, model_type, ep):
    ranks2.run(check_global_aux_loss, model_type, ep)


def test_global_aux_loss_accumulated_world2(ranks2):
    ranks2.run(check_global_aux_loss, "mixtral", 1, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_global_aux_loss_dp4(ranks4, model_type):
    ranks4.run(check_global_aux_loss, model_type)


def test_global_aux_loss_ep2_dp4(ranks4):
    ranks4.run(check_global_aux_loss, "qwen3_moe", 2)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nxd_trainer_dp2_with_aux_matches_trainer(ranks2, tmp_path, accumulate):
    ranks2.run(moe_pp.trainer_matches_hf, "mixtral", str(tmp_path), accumulate=accumulate, pp=1)


def test_nxd_trainer_ep2_zero1_with_aux_matches_trainer(ranks2, tmp_path):
    ranks2.run(check_trainer_matches, "qwen3_moe", str(tmp_path), 2, 2, True, True)


def test_nxd_trainer_dp4_with_aux_matches_trainer(ranks4, tmp_path):
    ranks4.run(moe_pp.trainer_matches_hf, "qwen3_moe", str(tmp_path), pp=1)


def test_global_aux_loss_only_in_training_and_for_hf_formula(ranks2):
    ranks2.run(check_hook_scope)


def test_global_aux_loss_tp2_dp2(ranks4):
    ranks4.run(check_global_aux_loss, "mixtral", 1, 1, 2)
