"""nnScaler's build_optimizer, merged / deduped state dicts, broadcast_weights and gen_savedir
(``nxd_hf.nnscaler``) on HF models parallelized by nxd_hf, against the unparallelized model and
torch's Adam (cases in tests/nnscaler_state_cases.py), and a script written against the
reference document under torchrun."""

import os
import re
import subprocess
import sys

import pytest

import nxd_hf.nnscaler

from nnscaler_state_cases import (
    broadcast_equalizes_replicas, deduped_roundtrip, gen_savedir_case, load_merged_at_another_layout,
    merged_matches_reference, nnscaler_doc_samples, submodule_matches_reference,
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


@pytest.mark.parametrize("model_type,tp,pp", [("llama", 2, 1), ("qwen2", 1, 2)])
def test_broadcast_weights_equalizes_replicas(ranks4, model_type, tp, pp):
    ranks4.run(broadcast_equalizes_replicas, model_type, tp, pp)


def test_gen_savedir_reuse_and_broadcast(ranks2, tmp_path):
    ranks2.run(gen_savedir_case, str(tmp_path))


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.usefixtures("no_rank_pool")
@pytest.mark.parametrize("args", [
    ["--example", "1", "--policy", "tp", "--plan_ngpus", "2", "--use_zero"],
    ["--example", "3", "--policy", "tp", "--plan_ngpus", "2"],
])
def test_nnscaler_script_under_torchrun(tmp_path, args):
    """A script written against the reference document (imports from nxd_hf.nnscaler) trains under
    torchrun, and the original module loaded with its merged state dicts computes the same outputs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "examples/nnscaler_example.py",
               *args, "--gen_savedir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", result.stdout).groups())
    assert last < first, result.stdout
    assert "computes the parallel module's outputs" in result.stdout


def test_gen_savedir_in_one_process(tmp_path):
    """Without torch.distributed: bad enum values and a changed plan under MATCH are ValueErrors; a
    broadcast strategy has no other node to copy to (ignored with a warning)."""
    from nxd_hf.nnscaler import BroadcastGenFilesStrategy, ReuseType, prepare_gen_savedir

    with pytest.raises(ValueError, match="reuse must be one of"):
        prepare_gen_savedir(tmp_path, None, {"a": 1}, "sometimes")
    with pytest.raises(ValueError, match="JSON"):
        prepare_gen_savedir(tmp_path, None, {"a": object()}, ReuseType.MATCH)
    with pytest.warns(UserWarning, match="broadcast_strategy='all' is ignored"):
        files = prepare_gen_savedir(tmp_path, None, {"a": 1}, ReuseType.MATCH, "all")
    assert files.strategy == BroadcastGenFilesStrategy.NONE and not files.reused
    assert prepare_gen_savedir(tmp_path, None, {"a": 1}, "match").reused
    with pytest.raises(ValueError, match="differs in \\['a'\\]"):
        prepare_gen_savedir(tmp_path, None, {"a": 2}, "match")
    assert not prepare_gen_savedir(tmp_path, None, {"a": 2}, "override").reused
    with pytest.raises(ValueError, match="init_module_params=False"):
        files.load_init_weights()


def test_reference_samples_on_parallel_modules(ranks2, tmp_path):
    """nnscaler-parallel-module.md's build_optimizer / reducer hooks / merge / load merged /
    deduped / load deduped / broadcast_weights samples on ParallelModules."""
    ranks2.run(nnscaler_doc_samples, str(tmp_path))
