"""Expert parallelism for LongCat-Flash (routed experts split over EP, identity experts on the
token's own rank; issue 24), at ep=2 and tp2 x ep2, exact against HF (tests/moe_longcat_ep_cases.py)."""

import pytest

from moe_longcat_ep_cases import checkpoint_reshards, pretrained_round_trip, training_matches_hf


def _check(results: list[dict], tp: int) -> None:
    assert all(r["identity_hits"] > 0 for r in results), "some tokens must reach an identity expert"
    for r in results:
        inner = 16 * 2 // tp  # gate_up rows of each expert: 2 x expert_ffn_hidden_size, split over TP
        experts = 2 + (2 if r["ep_rank"] == 1 else 0)  # 2 routed each; the last rank keeps the 2 identity slots
        assert r["shapes"]["gate_up_proj"] == (experts, inner, 32), r
        assert r["shapes"]["down_proj"] == (2, 32, 16 // tp), r


def test_longcat_ep2_matches_hf(ranks2):
    """Loss, every gathered gradient over 3 AdamW steps, eval logits at ep=2 (world 2)."""
    _check(ranks2.run(training_matches_hf, 1, 2), tp=1)


def test_longcat_tp2_ep2_matches_hf(ranks4):
    _check(ranks4.run(training_matches_hf, 2, 2), tp=2)


def test_longcat_checkpoint_ep2_reloads_at_ep1(ranks2, tmp_path):
    """save_checkpoint at ep=2 (the last rank's block holds the identity slots), load at ep=1 (dp 2) and ep=2."""
    ranks2.run(checkpoint_reshards, str(tmp_path / "ckpt"), (1, 2), [(1, 1), (1, 2)])


def test_longcat_checkpoint_tp2_ep2_reshards(ranks4, tmp_path):
    ranks4.run(checkpoint_reshards, str(tmp_path / "ckpt"), (2, 2), [(1, 1), (1, 2), (2, 1)])


@pytest.mark.parametrize("tp,ep,ranks", [(1, 2, "ranks2"), (2, 2, "ranks4")], ids=["ep2", "tp2_ep2"])
def test_longcat_from_pretrained_and_consolidate(request, tmp_path, tp, ep, ranks):
    request.getfixturevalue(ranks).run(pretrained_round_trip, str(tmp_path), tp, ep)
