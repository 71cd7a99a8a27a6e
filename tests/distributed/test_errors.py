"""Bad input and faults end in a clear error on every rank: never a silent wrong result, never a
hang. Single-process cases first, then one world-2 spawn running the distributed ones."""

import datetime
import json
import os
import re
import shutil
import time

import pytest
import torch
import transformers
from torch import nn

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.guards.input_check import ENV_VAR
from support import hf_parity


# (config key, value in config.json) against weights saved with hidden 64, intermediate 128, vocab 128
MISMATCHES = [("intermediate_size", 64, "mlp.gate_proj.weight"), ("vocab_size", 100, "embed_tokens.weight"),
              ("hidden_size", 32, "embed_tokens.weight")]
PROMPT_S = 10  # a failure agreed between ranks takes well under a second; a hang would take minutes


def _expect(error_class, pattern: str, fn, *args, **kwargs) -> float:
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except error_class as error:
        assert re.search(pattern, str(error), re.S), f"rank {backend.rank()}: {error!r} does not match {pattern!r}"
        elapsed = time.monotonic() - start
        assert elapsed < PROMPT_S, f"{fn.__name__} took {elapsed:.1f}s to fail"
        return elapsed
    name = getattr(fn, "__name__", type(fn).__name__)
    raise AssertionError(f"rank {backend.rank()}: {name} raised no {error_class.__name__}")


def _from_pretrained(path, **kwargs):
    parallel_state.destroy_model_parallel()
    return nxd_hf.from_pretrained(path, tensor_parallel_size=2, **kwargs)


def check_loading(paths: dict) -> None:
    for key, _, tensor in MISMATCHES:  # config.json disagrees with the weights
        _expect(ValueError, rf"size mismatch for \S*{re.escape(tensor)}: copying a param with shape", _from_pretrained,
                paths[key])
    for model_type in ("gpt2", "phi3", "qwen2"):  # the shape check accepts every layout it should
        model = _from_pretrained(paths[model_type])
        reference = transformers.AutoModelForCausalLM.from_pretrained(paths[model_type]).eval()
        ids, _ = hf_parity.batch()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **hf_parity.TOL)
    # one rank's copy of the checkpoint is truncated: both ranks raise, naming that rank and the file
    path = paths["broken"] if backend.rank() == 1 else paths["good"]
    _expect(ValueError, r"failed on rank 1 .*cannot read .*broken/model\.safetensors.*truncated", _from_pretrained,
            path)


def check_parallelize_failing_on_one_rank() -> None:
    """q_proj has fewer rows than the heads need: only rank 1's slice runs past the end."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    model.model.layers[0].self_attn.q_proj = torch.nn.Linear(48, 40)
    _expect(ValueError, r"nxd_hf.parallelize failed on rank 1 .*IndexError", nxd_hf.parallelize, model,
            tensor_parallel_size=2)


def check_inputs_tp2() -> None:
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2, check_inputs="always")
    rank = backend.rank()
    ids, labels = hf_parity.batch()
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)  # the same batch passes
    too_big = ids.clone()
    too_big[0, 0] = hf_parity.VOCAB - 1 + rank  # rank 1 alone is out of range: both raise
    _expect(ValueError, r"input_ids on rank 1 hold ids in \[\d+, 101\]", model, input_ids=too_big)
    bad_labels = labels.clone()
    bad_labels[0, -1] = -1
    _expect(ValueError, r"labels on rank 0 hold values in \[-1, ", model, input_ids=ids, labels=bad_labels)
    other, _ = hf_parity.batch(seed=1 + rank)  # same shape, different tokens
    same_batch = r"ranks \[0, 1\] .* got different inputs .*must get the same batch.*DistributedSampler"
    _expect(ValueError, same_batch, model, input_ids=other, labels=other)
    short, short_labels = hf_parity.batch(s=8 - 2 * rank)  # different lengths: a ValueError, not gloo's mismatch
    _expect(ValueError, same_batch, model, input_ids=short, labels=short_labels)


def _train_step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return float(loss)


def check_later_steps_tp2() -> dict:
    """Bad inputs after the first step, with the default check_inputs=True (the host check ran
    on step 1 only): ids and labels out of range raise on the device check, TP ranks given
    different batches are caught at the next step, different sequence lengths at once."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    rank, out = backend.rank(), {}
    ids, labels = hf_parity.batch()
    assert _train_step(model, ids, labels) > 0  # step 1: the host check
    too_big = ids.clone()
    too_big[1, 3] = hf_parity.VOCAB  # the tokenizer of a bigger vocabulary: every rank gets it
    _expect(ValueError, r"every-step check\): input_ids hold an id outside \[0, 101\)", model, input_ids=too_big,
            labels=labels)
    bad_labels = labels.clone()
    bad_labels[0, 2] = hf_parity.VOCAB + 5
    _expect(ValueError, r"every-step check\): labels hold a value that is neither a token id in \[0, 101\) nor -100",
            model, input_ids=ids, labels=bad_labels)
    same_batch = r"ranks \[0, 1\] .* got different inputs .*must get the same batch.*DistributedSampler"
    other, other_labels = hf_parity.batch(seed=7 + rank)  # same shapes, different tokens
    out["differs_step"] = _train_step(model, other, other_labels)  # runs: its fingerprints are in flight
    _expect(ValueError, same_batch, _train_step, model, ids, labels)  # the next step raises
    assert _train_step(model, ids, labels) > 0  # the same batch again: the model still works
    short, short_labels = hf_parity.batch(s=8 - 2 * rank)  # different sequence lengths on a later step
    _expect(ValueError, same_batch, _train_step, model, short, short_labels)
    return out


def check_later_steps_unchecked() -> None:
    """check_inputs=False turns the every-step checks off: an id out of range goes through."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2, check_inputs=False)
    ids, labels = hf_parity.batch()
    ids[1, 3], labels[0, 2] = hf_parity.VOCAB, hf_parity.VOCAB + 5
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)


def check_inputs_pp2() -> None:
    """Pipeline stages given different batches (run_train's check)."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2)
    ids, labels = hf_parity.batch(seed=1 + backend.rank())
    _expect(ValueError, r"ranks \[0, 1\] .* got different inputs", pp_model.run_train, input_ids=ids, labels=labels)
    # more stages than layers names the layers, not the schedule's microbatch arithmetic it also breaks
    parallel_state.destroy_model_parallel()
    _, one_layer = hf_parity.build_pair("llama", num_hidden_layers=1)
    _expect(ValueError, r"2 pipeline stages .* only 1 transformer layers: use at most 1 stages", nxd_hf.parallelize,
            one_layer, pipeline_parallel_size=2, num_microbatches=1)


def _model_fn_failing_on_rank1():
    if backend.rank() == 1:
        raise OSError("disk quota exceeded")  # what a node can run into alone
    return hf_parity.build_pair("llama")[1]


def check_config_api_fails_together() -> None:
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2)
    _expect(ValueError, r"initialize_parallel_model \(model_fn\) failed on rank 1 .*OSError: disk quota exceeded",
            nxd_hf.initialize_parallel_model, config, _model_fn_failing_on_rank1)
    ids, labels = hf_parity.batch(seed=1 + backend.rank())  # TP ranks given different batches
    model = nxd_hf.initialize_parallel_model(config, lambda: hf_parity.build_pair("llama")[1])
    _expect(ValueError, r"got different inputs", model.run_train, input_ids=ids, labels=labels)
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2, check_inputs=False)
    model = nxd_hf.initialize_parallel_model(config, lambda: hf_parity.build_pair("llama")[1])
    assert torch.isfinite(model.run_train(input_ids=ids, labels=labels))  # unchecked, as configured


def _lone(call, timeout_s: float, pattern: str) -> None:
    """Rank 0 enters ``call`` alone; rank 1 waits past the timeout without any collective."""
    if backend.rank() == 0:
        elapsed = _expect(TimeoutError, pattern, call)
        assert timeout_s * 0.9 < elapsed < timeout_s + 5, elapsed
    else:
        time.sleep(timeout_s + 2)
    backend.barrier()  # the world group (the spawn's 120 s timeout): both ranks go on together


def check_timeouts() -> None:
    parallel_state.destroy_model_parallel()
    nxd_hf.neuronx_distributed_config(tensor_parallel_size=2, timeout=1.5)
    _lone(lambda: backend.all_reduce(torch.ones(1), parallel_state.get_tensor_model_parallel_group()), 1.5,
          r"all_reduce on the tensor-parallel \(tp\) group \(global ranks \[0, 1\]\) timed out after 1.5s.*timeout=")
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2, timeout=1.5)
    ids, _ = hf_parity.batch()
    _lone(lambda: model(input_ids=ids), 1.5, r"on the model-parallel \(tp x pp\) group .*timed out")  # one extra step


def run_world2_cases(paths: dict) -> None:
    check_loading(paths)
    check_parallelize_failing_on_one_rank()
    check_inputs_tp2()
    check_inputs_pp2()
    check_config_api_fails_together()
    check_timeouts()


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
    ranks2.run(check_loading, error_paths)


def test_parallelize_failing_on_one_rank_fails_on_every_rank(ranks2):
    ranks2.run(check_parallelize_failing_on_one_rank)


def test_inputs_differing_across_tp_ranks_tp2(ranks2):
    ranks2.run(check_inputs_tp2)


def test_bad_inputs_on_later_steps_caught_every_step_tp2(ranks2):
    """Out-of-range ids and labels on step 2 raise (the device checks); TP ranks given different
    batches raise within one step, different sequence lengths at once (the fingerprint)."""
    ranks2.run(check_later_steps_tp2)


def test_check_inputs_false_turns_the_every_step_checks_off(ranks2):
    ranks2.run(check_later_steps_unchecked)


def test_inputs_checked_across_pipeline_stages_pp2(ranks2):
    ranks2.run(check_inputs_pp2)


def test_config_api_fails_together(ranks2):
    ranks2.run(check_config_api_fails_together)


def test_collective_timeouts_name_the_group(ranks2):
    ranks2.run(check_timeouts)
