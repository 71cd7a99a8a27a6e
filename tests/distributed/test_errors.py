"""Bad input and faults end in a clear error on every rank: never a silent wrong result, never a
hang. Single-process cases first, then one world-2 spawn running the distributed ones."""

import datetime
import json
import os
import re
import shutil

import pytest
import torch
import transformers
from torch import nn

import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.guards.input_check import ENV_VAR
import errors_world2
from errors_world2 import MISMATCHES

VOCAB = 128


def _llama(**overrides):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                      tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _save_mismatched(root) -> dict[str, str]:
    """The good checkpoint and, per MISMATCHES entry, a copy whose config.json disagrees."""
    good = os.path.join(root, "good")
    _llama().save_pretrained(good)
    paths = {"good": good}
    for key, value, _ in MISMATCHES:
        path = os.path.join(root, key)
        shutil.copytree(good, path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config[key] = value
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        paths[key] = path
    return paths


def _truncate(path: str, keep: float = 0.5) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


# --- single process ---


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size="2"), dict(tensor_parallel_size=2.0),
                                    dict(pipeline_parallel_size="1"), dict(tensor_parallel_size=True)])
def test_parallelize_sizes_must_be_ints(kwargs):
    _, model = hf_parity.build_pair("llama")
    with pytest.raises(ValueError, match=r"_parallel_size must be an int >= 1, got .*pass e\.g\."):
        nxd_hf.parallelize(model, **kwargs)


def test_parallelize_plain_module_is_not_a_hugging_face_model():
    with pytest.raises(ValueError, match="Linear is not a Hugging Face model.*PreTrainedModel"):
        nxd_hf.parallelize(nn.Linear(4, 4))


def test_parallelize_misspelled_argument_is_named_with_the_closest():
    _, model = hf_parity.build_pair("llama")
    with pytest.raises(ValueError, match=r"unknown argument\(s\) 'tensor_paralel_size' \(did you mean "
                                         r"'tensor_parallel_size'\?\)"):
        nxd_hf.parallelize(model, tensor_paralel_size=2)


@pytest.mark.parametrize("tp,pp,procs", [(2, 1, 2), (2, 2, 4)])
def test_tp_without_torchrun_says_how_to_launch(tp, pp, procs):
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    assert backend.world_size() == 1
    with pytest.raises(ValueError, match=rf"world size 1 .* `torchrun --nproc_per_node {procs} your_script.py`"):
        nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_from_pretrained_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="'missing/dir' does not exist.*never downloads.*snapshot_download"):
        nxd_hf.from_pretrained("missing/dir")


def test_truncated_or_corrupted_safetensors_names_the_file(tmp_path):
    parallel_state.destroy_model_parallel()
    _llama().save_pretrained(tmp_path / "single")
    _llama().save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    _truncate(str(tmp_path / "single" / "model.safetensors"))
    _truncate(str(shards[-1]), keep=0.9)
    for path, broken in ((tmp_path / "single", "model.safetensors"), (tmp_path / "sharded", shards[-1].name)):
        with pytest.raises(ValueError, match=rf"cannot read .*{re.escape(broken)}: .* truncated or corrupted"):
            nxd_hf.from_pretrained(str(path))
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors\.index\.json"):
        nxd_hf.from_pretrained(str(tmp_path / "sharded"))


def test_config_disagreeing_with_weights_is_a_size_mismatch_tp1(tmp_path):
    paths = _save_mismatched(str(tmp_path))
    for key, value, tensor in MISMATCHES:
        parallel_state.destroy_model_parallel()
        with pytest.raises(ValueError, match=rf"size mismatch for \S*{re.escape(tensor)}: copying a param with shape "
                                             r".* from checkpoint, the shape in current model is .*fix config\.json"):
            nxd_hf.from_pretrained(paths[key])
    parallel_state.destroy_model_parallel()
    nxd_hf.from_pretrained(paths["good"])


def _forward(model, ids, labels=None):
    return model(input_ids=ids, labels=labels)


def test_input_check_modes_single_process(monkeypatch):
    ids, labels = hf_parity.batch()
    bad_ids = ids.clone()
    bad_ids[0, 1] = hf_parity.VOCAB  # one past the vocabulary
    bad_labels = labels.clone()
    bad_labels[1, 0] = 500

    def parallelized(**kwargs):
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama")
        return nxd_hf.parallelize(model, **kwargs)

    model = parallelized()
    with pytest.raises(ValueError, match=r"input_ids on rank 0 hold ids in \[\d+, 101\].*must be in \[0, 101\)"):
        _forward(model, bad_ids)
    # the first step only: later the check is skipped, and at tp=1 the embedding is a plain
    # lookup (no vocab-parallel zeros), so torch's own error surfaces as in plain HF; at tp > 1
    # ids no rank holds would give zeros, which is what "always" is for
    with pytest.raises(IndexError, match="index out of range"):
        _forward(model, bad_ids)
    model = parallelized(check_inputs="always")
    with pytest.raises(ValueError, match=r"labels on rank 0 hold values in \[\d+, 500\].*or -100"):
        _forward(model, ids, bad_labels)
    _forward(model, ids, labels)
    with pytest.raises(ValueError, match="every id must be"):
        _forward(model, bad_ids)
    with pytest.raises(IndexError):  # off: no check of nxd_hf's, torch's own lookup error (as plain HF)
        _forward(parallelized(check_inputs=False), bad_ids)
    monkeypatch.setenv(ENV_VAR, "0")
    with pytest.raises(IndexError):  # the environment variable wins: again torch's error, not the check's
        _forward(parallelized(check_inputs="always"), bad_ids)
    monkeypatch.setenv(ENV_VAR, "always")
    model = parallelized(check_inputs=False)
    for _ in range(2):
        with pytest.raises(ValueError, match="every id must be"):
            _forward(model, bad_ids)
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=rf"\${ENV_VAR}='sometimes': use 0 \(off\), 1"):
        parallelized()


def test_check_inputs_and_timeout_arguments_are_validated():
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    with pytest.raises(ValueError, match="check_inputs must be True, False or 'always'"):
        nxd_hf.parallelize(model, check_inputs="sometimes")
    for timeout in ("3", -1, 0):
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama")
        with pytest.raises(ValueError, match="timeout must be"):
            nxd_hf.parallelize(model, timeout=timeout)
        with pytest.raises(ValueError, match="timeout"):
            nxd_hf.neuronx_distributed_config(timeout=timeout)
    with pytest.raises(ValueError, match="check_inputs.*wrong type"):
        nxd_hf.neuronx_distributed_config(check_inputs="sometimes")
    parallel_state.initialize_model_parallel(1, 1, timeout=datetime.timedelta(seconds=60))
    _, model = hf_parity.build_pair("llama")
    with pytest.warns(UserWarning, match="timeout is ignored: parallel_state is already initialized"):
        nxd_hf.parallelize(model, timeout=5)


# --- world 2: every rank raises, promptly ---


@pytest.fixture(scope="module")
def error_paths(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("errors")
    paths = _save_mismatched(str(tmp_path / "mismatch"))
    for model_type in ("gpt2", "phi3", "qwen2"):  # Conv1D (stored transposed), fused projections, tied head
        hf_parity.build_pair(model_type)[0].save_pretrained(tmp_path / model_type)
        paths[model_type] = str(tmp_path / model_type)
    broken = str(tmp_path / "broken")  # the checkpoint as one node with a damaged copy sees it
    shutil.copytree(paths["good"], broken)
    _truncate(os.path.join(broken, "model.safetensors"))
    paths["broken"] = broken
    return paths


def test_loading_mismatched_or_broken_weights_raises_on_every_rank(ranks2, error_paths):
    ranks2.run(errors_world2.check_loading, error_paths)


def test_parallelize_failing_on_one_rank_fails_on_every_rank(ranks2):
    ranks2.run(errors_world2.check_parallelize_failing_on_one_rank)


def test_inputs_differing_across_tp_ranks_tp2(ranks2):
    ranks2.run(errors_world2.check_inputs_tp2)


def test_bad_inputs_on_later_steps_caught_every_step_tp2(ranks2):
    """Out-of-range ids and labels on step 2 raise (the device checks); TP ranks given different
    batches raise within one step, different sequence lengths at once (the fingerprint)."""
    ranks2.run(errors_world2.check_later_steps_tp2)


def test_check_inputs_false_turns_the_every_step_checks_off(ranks2):
    ranks2.run(errors_world2.check_later_steps_unchecked)


def test_inputs_checked_across_pipeline_stages_pp2(ranks2):
    ranks2.run(errors_world2.check_inputs_pp2)


def test_config_api_fails_together(ranks2):
    ranks2.run(errors_world2.check_config_api_fails_together)


def test_collective_timeouts_name_the_group(ranks2):
    ranks2.run(errors_world2.check_timeouts)
