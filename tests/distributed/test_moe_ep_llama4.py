"""Expert parallelism for Llama 4's dense experts (every token through every expert): exact against
the unparallelized HF model (tests/moe_ep_llama4_cases.py)."""

from moe_ep_llama4_cases import (
    checkpoint_ep2_to_ep1, from_pretrained_reads_local_experts, training_matches_hf, uneven_batches_match_hf,
    pipeline_ep_matches_hf, zero1_matches_hf,
)


def test_llama4_ep2_world2_matches_hf(ranks2):
    names = ranks2.run(training_matches_hf, 1, 2)[0]
    assert len(names) == 4 and all("experts" in n for n in names), names


def test_llama4_tp2_ep2_world4_matches_hf(ranks4):
    names = ranks4.run(training_matches_hf, 2, 2)[0]
    assert len(names) == 4, names


def test_llama4_ep2_dp4_matches_hf(ranks4):
    ranks4.run(training_matches_hf, 1, 2)


def test_llama4_ep2_uneven_batches_match_hf(ranks2):
    ranks2.run(uneven_batches_match_hf)


def test_llama4_checkpoint_ep2_to_ep1_and_transformers(ranks2, tmp_path):
    ranks2.run(checkpoint_ep2_to_ep1, str(tmp_path / "ckpt"))


def test_llama4_from_pretrained_ep2_reads_local_experts(ranks2, tmp_path):
    ranks2.run(from_pretrained_reads_local_experts, str(tmp_path / "hf"), 1, 2)


def test_llama4_from_pretrained_tp2_ep2_reads_local_experts(ranks4, tmp_path):
    ranks4.run(from_pretrained_reads_local_experts, str(tmp_path / "hf"), 2, 2)


def test_llama4_zero1_ep2_world2_matches_hf(ranks2):
    ranks2.run(zero1_matches_hf, 2)


def test_llama4_zero1_ep2_dp4_matches_hf(ranks4):
    ranks4.run(zero1_matches_hf, 2)


def test_llama4_pp2_ep2_world4_matches_hf(ranks4):
    assert ranks4.run(pipeline_ep_matches_hf)[0] > 0
