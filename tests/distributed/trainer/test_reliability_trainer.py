"""NxDTrainer features that were silently ignored or wrong, against transformers.Trainer:
``load_best_model_at_end`` (best_metric / best_model_checkpoint tracked, the best checkpoint kept by
``save_total_limit`` and loaded at the end); a changed ``trainer_state.json`` refused on resume (it
would resume at the wrong step); datasets and batches too small for the data-parallel world. One
spawn of 2 ranks (tp=2 for the Trainer comparison, dp=2 for the data cases)."""

import json
import os
import shutil

import pytest
import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor
from nxd_hf.testing import run_distributed
from support.errors import assert_same_error_on_every_rank
from test_nxd_trainer import COMMON, _dataset

BEST = dict(COMMON, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
            save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
"""The highest evaluation loss is the best: the first checkpoint, so the best is not the last one."""


def _reference_best(out_dir):
    """transformers.Trainer on one process (in the test process: no torch.distributed)."""
    reference, _ = hf_parity.build_pair("llama")
    data = _dataset()
    ref = transformers.Trainer(reference, transformers.TrainingArguments(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=4, **BEST), train_dataset=data, eval_dataset=data[:6])
    ref.train()
    return {"best": (ref.state.best_metric, os.path.basename(ref.state.best_model_checkpoint or "")),
            "kept": sorted(n for n in os.listdir(f"{out_dir}/ref") if n.startswith("checkpoint-")),
            "params": {n: p.detach() for n, p in ref.model.named_parameters()}}


def _best_case(out_dir):
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    data = _dataset()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4,
                                       tensor_parallel_size=2, **BEST)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data, eval_dataset=data[:6])
    ours.train()
    backend.barrier()  # rank 0 deletes the checkpoints save_total_limit=1 does not keep, as Trainer does
    return {"best": (ours.state.best_metric, os.path.basename(ours.state.best_model_checkpoint or "")),
            "kept": sorted(n for n in os.listdir(f"{out_dir}/nxd") if n.startswith("checkpoint-")),
            "params": {n: full_tensor(p).numpy().copy()  # by value
                       for n, p in ours.nxd_model.named_parameters()}}


def _train(out_dir, data, *, resume=None, steps=2, **layout):
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, per_device_train_batch_size=1,
                                       **dict(COMMON, max_steps=steps, save_strategy="steps", save_steps=2), **layout)
    trainer = nxd_hf.NxDTrainer(model, args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


def _old_format(run_dir):
    """Checkpoints as versions before checksummed metadata wrote them (``done`` without the index's
    checksum, metadata files not in the index): one whose trainer_state.json is lost, one whose
    global_step was changed. Returns their paths."""
    _train(run_dir, _dataset(), steps=2, tensor_parallel_size=2)
    checkpoint = f"{run_dir}/checkpoint-2"
    if backend.rank() == 0:
        with open(f"{checkpoint}/index.json") as f:
            index = json.load(f)
        index["files"] = {k: v for k, v in index["files"].items() if k.endswith(".safetensors")}
        with open(f"{checkpoint}/index.json", "w") as f:
            json.dump(index, f)
        with open(f"{checkpoint}/done", "w") as f:
            f.write("complete\n")
        shutil.copytree(checkpoint, f"{run_dir}/lost/checkpoint-2")
        os.remove(f"{run_dir}/lost/checkpoint-2/trainer_state.json")
        with open(f"{checkpoint}/trainer_state.json") as f:
            text = f.read()
        with open(f"{checkpoint}/trainer_state.json", "w") as f:
            f.write(text.replace('"global_step": 2,', '"global_step": 3,'))
    backend.barrier()
    return f"{run_dir}/lost/checkpoint-2", checkpoint


def trainer_cases(out_dir):
    out = {"best": _best_case(out_dir)}
    out["resolved_after_run"] = os.path.basename(nxd_hf.checkpoint.load.read_index(f"{out_dir}/nxd", None)[0])
    _train(f"{out_dir}/run", _dataset(), steps=2, tensor_parallel_size=2)
    state = f"{out_dir}/run/checkpoint-2/trainer_state.json"
    if backend.rank() == 0:
        with open(state) as f:
            text = f.read()
        assert '"global_step": 2,' in text
        with open(state, "w") as f:  # one byte changed: the probe's case
            f.write(text.replace('"global_step": 2,', '"global_step": 3,'))
    backend.barrier()
    out["tampered_state"] = _error(_train, f"{out_dir}/run", _dataset(), resume=f"{out_dir}/run/checkpoint-2",
                                   steps=4, tensor_parallel_size=2)
    lost, changed = _old_format(f"{out_dir}/old")
    out["old_format_lost_state"] = _error(_train, f"{out_dir}/old1", _dataset(), resume=lost, steps=4,
                                          tensor_parallel_size=2)
    out["old_format_changed_step"] = _error(_train, f"{out_dir}/old2", _dataset(), resume=changed, steps=4,
                                            tensor_parallel_size=2)
    out["one_sample"] = _error(_train, f"{out_dir}/one", _dataset(n=1))  # dp=2
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(trainer_cases, 2, str(tmp_path_factory.mktemp("trainer")), timeout_s=600)


def test_load_best_model_at_end_as_trainer(results, tmp_path):
    ref = _reference_best(str(tmp_path))
    assert ref["best"][1] == "checkpoint-2" and ref["kept"] == ["checkpoint-2"], ref
    for r in results:
        ours = r["best"]
        assert r["resolved_after_run"] == "checkpoint-2"
        assert ours["best"][1] == ref["best"][1] and ours["kept"] == ref["kept"], (ours["best"], ours["kept"])
        assert ours["best"][0] == pytest.approx(ref["best"][0], rel=1e-4)
        for name, param in ref["params"].items():  # the best model was loaded, as Trainer loads it
            torch.testing.assert_close(torch.from_numpy(ours["params"][name]), param, **hf_parity.TOL)


EXPECTED_ERRORS = {  # case -> the message every rank raises
    "tampered_state": r"checkpoint-2/trainer_state.json does not match its checksum",
    "old_format_lost_state": r"lost/checkpoint-2 has no trainer_state.json",
    "old_format_changed_step": r"checkpoint-2: it was saved at step 2 but the trainer state resumes at step 3",
    "one_sample": r"the train_dataset has 1 samples but there are 2 data-parallel replicas",
}


@pytest.mark.parametrize("case", list(EXPECTED_ERRORS))
def test_same_value_error_on_every_rank(results, case):
    assert_same_error_on_every_rank(results, case, EXPECTED_ERRORS[case])
