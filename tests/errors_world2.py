"""The world-2 bodies of ``test_errors.py``: each case makes one or both ranks fail and checks
that every rank raises the documented error, within seconds (no hang, nothing loaded silently)."""

import re
import time

import torch
import transformers

import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state

# (config key, value in config.json) against weights saved with hidden 64, intermediate 128, vocab 128
MISMATCHES = [("intermediate_size", 64, "mlp.gate_proj.weight"), ("vocab_size", 100, "embed_tokens.weight"),
              ("hidden_size", 32, "embed_tokens.weight")]
PROMPT_S = 10  # a failure agreed between ranks takes well under a second; a hang would take minutes


def assert_same_error_on_every_rank(results: list[dict], case: str, pattern: str) -> None:
    """``results``: each rank's {case: the error message it raised}; every rank raised the same
    one, and it matches ``pattern``."""
    assert all(r[case] == results[0][case] for r in results), [r[case] for r in results]
    assert re.search(pattern, results[0][case], re.S), results[0][case]


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
