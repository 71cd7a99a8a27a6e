"""nnScaler's build_optimizer, merged / deduped state dicts, broadcast_weights and gen_savedir
(``nxd_hf.nnscaler``) on HF models parallelized by nxd_hf, against the unparallelized model and
torch's Adam (cases in tests/nnscaler_state_cases.py)."""

import pytest

from nnscaler_state_cases import (
    broadcast_equalizes_replicas, deduped_roundtrip, gen_savedir_case, load_merged_at_another_layout,
    merged_matches_reference, submodule_matches_reference,
)


@pytest.mark.parametrize("model_type,tp,pp,zero", [
    ("llama", 2, 1, True),  # tp=2 x dp=2, ZeRO-1; padded vocab, replicated K/V
    ("llama", 2, 1, False),  # tp=2 x dp=2 without ZeRO
    ("qwen2", 1, 2, True),  # pp=2 x dp=2, ZeRO-1; embeddings tied across the stages
    ("gpt2", 2, 2, False),  # tp=2 x pp=2; Conv1D (transposed), fused c_attn, tied head
])
def test_merged_state_dicts_match_the_original_module(ranks4, model_type, tp, pp, zero):
    ranks4.run(merged_matches_reference, model_type, tp, pp, zero)


@pytest.mark.parametrize("save,load", [
    ((2, 1, True), (1, 2, False)),
    ((1, 2, False), (2, 2, False)),
])
def test_load_merged_state_dicts_at_another_layout(ranks4, save, load):
    ranks4.run(load_merged_at_another_layout, "qwen2", save, load)


@pytest.mark.parametrize("save,load", [
    ((2, 1, True), (1, 2, True)),
    ((2, 2, False), (2, 1, True)),
])
def test_deduped_state_dicts_round_trip_at_other_layouts(ranks4, save, load):
    ranks4.run(deduped_roundtrip, "qwen2", save, load)


@pytest.mark.parametrize("zero", [False, True])
def test_plain_module_around_a_parallel_one(ranks4, zero):
    ranks4.run(submodule_matches_reference, 2, zero)


def test_broadcast_weights_equalizes_replicas(ranks4):
    ranks4.run(broadcast_equalizes_replicas, "llama", 2)


def test_gen_savedir_reuse_and_broadcast(ranks2, tmp_path):
    ranks2.run(gen_savedir_case, str(tmp_path))
