"""Pipeline x expert parallelism: pp=2 x ep=2 on 4 ranks against the unparallelized HF
model (cases in tests/moe_pp_ep_cases.py)."""

import pytest

import moe_pp_ep_cases as cases


def _run_parity(ranks4, model_type, **kwargs):
    results = ranks4.run(cases.pipeline_ep_matches_hf, model_type, **kwargs)
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
    results = ranks4.run(cases.pipeline_ep_matches_hf, "qwen3_moe", mlp_only_layers=[0, 1], accumulate=1, steps=2)
    assert [r["exchanges"] > 0 for r in results] == [False, False, True, True], results


@pytest.mark.parametrize("save,load", [((2, 2), (1, 1)), ((1, 1), (2, 2))], ids=["pp2ep2_to_pp1ep1", "pp1ep1_to_pp2ep2"])
def test_checkpoint_reshards_pp2_ep2(ranks4, tmp_path, save, load):
    ranks4.run(cases.checkpoint_reshards, "qwen3_moe", str(tmp_path / "ckpt"), save=save, load=load)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_from_pretrained_at_pp2_ep2_reads_local_experts(ranks4, tmp_path, model_type):
    ranks4.run(cases.from_pretrained_reads_local_experts, model_type, str(tmp_path))


@pytest.mark.parametrize("zero_1", [False, True], ids=["adamw", "zero1"])
def test_nxd_trainer_pp2_ep2_matches_trainer(ranks4, tmp_path, zero_1):
    ranks4.run(cases.trainer_matches_hf, "mixtral", str(tmp_path), zero_1=zero_1)


def test_refusals_pp2(ranks4):
    ranks4.run(cases.refusals)


def test_pp2_ep2_dp4_expert_data_reduction(ranks8):
    """World 8: pp=2 x dp=4 with two expert blocks per stage, so the experts' gradients are averaged
    over an expert_data group of 2 (the ranks holding the same experts)."""
    results = ranks8.run(cases.pipeline_ep_matches_hf, "qwen3_moe", accumulate=1, steps=2)
    assert all(r["exchanges"] > 0 for r in results)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_check_parity_case_at_pp2_ep2(ranks4, model_type):
    status, message = ranks4.run(cases.sweep_case, model_type)[0]
    assert status == "pass", message


@pytest.mark.parametrize("failing_rank", [1, 2])  # the first stage's second expert rank; the last stage's first
def test_one_expert_rank_failing_fails_every_rank(no_rank_pool, failing_rank):
    """Its expert-group peer, blocked in an all-to-all, and the other stage get the same ValueError
    at once (the groups are aborted, so fresh processes)."""
    from nxd_hf.testing import run_distributed

    results = run_distributed(cases.failing_expert_rank, 4, failing_rank, timeout_s=120)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(f"run_train failed on rank {failing_rank} "), message
    assert f"experts failed on purpose on rank {failing_rank}" in message, message
    assert max(elapsed for _, elapsed in results) < 10, results
