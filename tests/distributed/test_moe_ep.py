"""Expert parallelism: experts split over the expert-parallel group carved
from data parallelism, tokens dispatched by all-to-all, exact against the unparallelized HF
model (tests/moe_ep_cases.py)."""

import pytest

from moe_ep_cases import (
    check_bench_moe_figures, check_checkpoint_reshard, check_ep_training, check_from_pretrained_and_save, check_refusals,
    check_sweep_case, check_trainer_matches,
)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_world2_matches_hf(ranks2, model_type):
    ranks2.run(check_ep_training, model_type, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_dp4_matches_hf(ranks4, model_type):
    ranks4.run(check_ep_training, model_type, 2)


@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (1, 2)], ids=["ep2_to_ep1dp2", "ep1dp2_to_ep2"])
def test_checkpoint_reshards_across_ep(ranks2, tmp_path, save_ep, load_ep):
    ranks2.run(check_checkpoint_reshard, "mixtral", str(tmp_path / "ckpt"), save_ep, load_ep)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_from_pretrained_reads_local_experts_and_save_pretrained_writes_hf(ranks2, tmp_path, model_type):
    ranks2.run(check_from_pretrained_and_save, model_type, str(tmp_path), 2)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nxd_trainer_at_ep2_matches_trainer(ranks2, tmp_path, accumulate):
    ranks2.run(check_trainer_matches, "mixtral", str(tmp_path), 2, accumulate)


def test_refusals_world2(ranks2):
    ranks2.run(check_refusals)


def test_refusals_world4(ranks4):
    ranks4.run(check_refusals)


def test_bench_moe_figures(ranks2):
    ranks2.run(check_bench_moe_figures, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "phimoe"])  # phimoe: a router that samples in training
def test_sweep_ep2_layout_passes(ranks2, model_type):
    status, message = ranks2.run(check_sweep_case, model_type, 1, 2)[0]
    assert status == "pass", message


def test_sweep_tp2_ep2_layout_passes(ranks4):
    status, message = ranks4.run(check_sweep_case, "mixtral", 2, 2)[0]
    assert status == "pass", (status, message)


def test_check_command_at_ep2(tmp_path, capsys):
    import transformers

    from nxd_hf.cli import main

    transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
                                num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=4, vocab_size=500).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "1", "--ep", "2"]) == 0
    assert "(tp=1 pp=1 ep=2): pass" in capsys.readouterr().out


def test_checkpoint_reshards_ep2_dp4_to_ep1_dp4(ranks4, tmp_path):
    ranks4.run(check_checkpoint_reshard, "qwen3_moe", str(tmp_path / "ckpt"), 2, 1)


def test_ep2_rank_without_tokens_matches_hf(ranks2):
    ranks2.run(check_ep_training, "mixtral", 2, starve=True)
