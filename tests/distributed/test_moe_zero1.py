"""ZeRO-1 with expert parallelism: expert parameters' gradients, optimizer state and
master slices sharded over the expert-data group, the rest over the data group; exact against
single-process HF with AdamW and clipping (tests/moe_zero1_cases.py)."""

import pytest

from moe_ep_cases import check_checkpoint_reshard, check_trainer_matches
from moe_zero1_cases import check_zero1_ep_training


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
