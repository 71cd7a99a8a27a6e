"""The MoE load-balancing (aux) loss of the global batch at pipeline_parallel_size=1 with data and
expert parallelism (``nxd_hf.moe.replica_aux``): exact against the single-process
HF model (tests/moe_aux_cases.py) and NxDTrainer against transformers.Trainer."""

import pytest

import moe_pp_cases
from moe_aux_cases import check_global_aux_loss, check_hook_scope
from moe_ep_cases import check_trainer_matches


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
    ranks2.run(moe_pp_cases.trainer_matches_hf, "mixtral", str(tmp_path), accumulate=accumulate, pp=1)


def test_nxd_trainer_ep2_zero1_with_aux_matches_trainer(ranks2, tmp_path):
    ranks2.run(check_trainer_matches, "qwen3_moe", str(tmp_path), 2, 2, True, True)


def test_nxd_trainer_dp4_with_aux_matches_trainer(ranks4, tmp_path):
    ranks4.run(moe_pp_cases.trainer_matches_hf, "qwen3_moe", str(tmp_path), pp=1)


def test_global_aux_loss_only_in_training_and_for_hf_formula(ranks2):
    ranks2.run(check_hook_scope)


def test_global_aux_loss_tp2_dp2(ranks4):
    ranks4.run(check_global_aux_loss, "mixtral", 1, 1, 2)
