"""nnScaler's ``parallelize`` / ``ComputeConfig`` / ``ParallelModule`` on
nxd_hf's engine: the document's three examples with small real modules, parity with the
unparallelized module over several optimizer steps (cases in ``tests/nnscaler_cases.py``)."""

import pytest

import nnscaler_cases as cases
import nnscaler_decoder_cases as decoder_cases


def test_example1_llm_tp2(ranks2, tmp_path):
    plans = ranks2.run(cases.llm_tp_matches, str(tmp_path))
    layouts = plans[0]["layouts"]
    assert layouts["layers.0.attn.q"] == "column" and layouts["layers.0.attn.o"] == "row"
    assert layouts["layers.1.attn.qkv_k"] == "column" and layouts["layers.1.attn.proj"] == "row"
    assert layouts["layers.0.mlp.up"] == "column" and layouts["layers.0.mlp.down"] == "row"
    assert layouts["embed"] == "vocab" and "head" not in layouts and "layers.0.norm1" not in layouts
    assert (tmp_path / "_" / "plan.json").exists()


def test_custom_policy(ranks2, tmp_path):
    ranks2.run(cases.custom_policy_matches, str(tmp_path))


def test_dp2_use_zero(ranks2, tmp_path):
    ranks2.run(cases.llm_dp_zero_matches, str(tmp_path))


def test_example3_end2end_mlp_pp2(ranks2, tmp_path):
    ranks2.run(cases.end2end_matches, str(tmp_path), "mlp", "pp", 2, 2)


def test_end2end_mlp_tp2(ranks2, tmp_path):
    ranks2.run(cases.end2end_matches, str(tmp_path), "mlp", "tp", 2, 2)


def test_end2end_llm_hybrid_tp2_pp2(ranks4, tmp_path):
    ranks4.run(cases.end2end_matches, str(tmp_path), "llm", "hybrid", 4, 4)


def test_end2end_llm_pp2_dp2(ranks4, tmp_path):
    ranks4.run(cases.end2end_matches, str(tmp_path), "llm", "pp", 2, 4)


def test_example2_hf_submodule_tp2_two_units(ranks4, tmp_path):
    ranks4.run(cases.hf_submodule_matches, str(tmp_path))


def test_training_flag_and_class_path(ranks2, tmp_path):
    ranks2.run(cases.training_flag_and_class_path, str(tmp_path))


def test_refused_class_build_leaves_no_plan(ranks2, tmp_path):
    ranks2.run(cases.refused_class_build_leaves_no_plan, str(tmp_path))


def test_errors_on_every_rank(ranks2, tmp_path):
    ranks2.run(cases.errors_on_every_rank, str(tmp_path))


def test_hf_model_pipelined(ranks2, tmp_path):
    ranks2.run(cases.hf_pipelined_matches, str(tmp_path))


def test_init_params_false_skips_the_replica_check(ranks2, tmp_path):
    ranks2.run(cases.init_params_false_replicas, str(tmp_path))


@pytest.mark.parametrize("policy,plan,runtime,zero", [
    ("dp", 1, 2, True),  # two units, ZeRO-1
    ("tp", 2, 2, False),  # attention by heads, MLP column -> row, embeddings by vocabulary
    ("pp", 2, 2, False),  # the mask crosses the stage boundary
])
def test_mask_decoder_trains_as_one_process(ranks2, tmp_path, policy, plan, runtime, zero):
    ranks2.run(decoder_cases.decoder_matches, str(tmp_path), policy, plan, runtime, zero)


def test_mask_decoder_hybrid_tp2_pp2(ranks4, tmp_path):
    ranks4.run(decoder_cases.decoder_matches, str(tmp_path), "hybrid", 4, 4)
