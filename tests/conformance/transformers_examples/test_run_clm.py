"""transformers' own examples/pytorch/language-modeling/run_clm.py (vendored unchanged, Apache-2.0,
its header), run with its ``Trainer`` and ``TrainingArguments`` swapped for ``nxd_hf.NxDTrainer``
and ``nxd_hf.NxDTrainingArguments`` (the two names a user changes) and nxd_hf's layout flags
added, against the plain script on one process with the global batch: the same log every step
(loss, grad norm, learning rate, input tokens seen), the same evaluation (its loss, perplexity and
the accuracy of ``preprocess_logits_for_metrics``'s argmax of the gathered logits) and the same
saved model, loaded in plain transformers. ``evaluate.load("accuracy")`` finds ./accuracy/ (the
Hub's metric needs the network) as the script runs from this folder."""

import contextlib
import json
import os
import tempfile
from unittest import mock

import pytest
import torch
import transformers

from support.paths import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(REPO, "examples", "data", "tiny-llama")
CORPUS = os.path.join(REPO, "examples", "data", "tiny_corpus.txt")
STEPS = 4
UNCOMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second",
              "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def _run(script, argv: list[str], nxd: bool) -> None:
    import nxd_hf

    swapped = {"Trainer": nxd_hf.NxDTrainer, "TrainingArguments": nxd_hf.NxDTrainingArguments} if nxd else {}
    with mock.patch.multiple(script, **swapped) if swapped else contextlib.nullcontext(), \
            mock.patch("sys.argv", ["run_clm.py", *argv]):
        script.main()


def script_case(layout: tuple, batch: int) -> None:
    """The plain script (rank 0, one process, ``batch`` x data-parallel replicas rows a step) and
    the swapped one on both ranks at ``layout``."""
    from nxd_hf import backend

    from . import run_clm as script
    dp = 2 if "--zero_1" in layout else 1
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        out = backend.all_gather_object(tmp)[0]  # rank 0's folder
        flags = ["--model_name_or_path", TINY, "--train_file", CORPUS, "--validation_split_percentage", "20",
                 "--block_size", "32", "--do_train", "--do_eval", "--max_steps", str(STEPS), "--logging_steps", "1",
                 "--report_to", "none", "--cache_dir", f"{out}/cache", "--seed", "7", "--learning_rate", "1e-3",
                 "--include_num_input_tokens_seen", "true", "--max_grad_norm", "0.5", "--disable_tqdm", "true"]
        try:
            os.chdir(HERE)
            # Trainer.end destroys the default process group: the pool's ranks run further cases on it
            with mock.patch.object(transformers.Trainer, "end", lambda self: None):
                if backend.rank() == 0:
                    _run(script, [*flags, "--output_dir", f"{out}/plain", "--per_device_train_batch_size", str(batch * dp),
                                  "--per_device_eval_batch_size", str(batch * dp)], nxd=False)
                backend.barrier()
                _run(script, [*flags, "--output_dir", f"{out}/nxd", "--per_device_train_batch_size", str(batch),
                              "--per_device_eval_batch_size", str(batch), *layout], nxd=True)
        finally:
            os.chdir(cwd)
        backend.barrier()
        _check(out, layout)
        backend.barrier()


def _check(out: str, layout: tuple) -> None:
    results = {}
    for run in ("plain", "nxd"):
        with open(f"{out}/{run}/trainer_state.json") as f:
            history = json.load(f)["log_history"]
        with open(f"{out}/{run}/eval_results.json") as f:
            results[run] = history, json.load(f)
    (want_logs, want_eval), (got_logs, got_eval) = results["plain"], results["nxd"]
    assert len(want_logs) == len(got_logs) == STEPS + 1, (want_logs, got_logs)
    assert want_logs[-1]["num_input_tokens_seen"] == STEPS * 4 * 32  # 4 rows of 32 tokens a step
    for want, got in [*zip(want_logs, got_logs), (want_eval, got_eval)]:
        assert set(want) == set(got), (layout, sorted(set(want) ^ set(got)))
        for key in set(want) - UNCOMPARED:
            if isinstance(want[key], float):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (layout, key, want, got)
            else:
                assert got[key] == want[key], (layout, key, want, got)
    plain = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/plain").state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/nxd").state_dict()
    assert set(plain) == set(ours)
    for key, value in plain.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{layout} {key}: {m}")


CASES = {  # id: (nxd_hf's layout flags, rows per step and replica)
    "tp2": (("--tensor_parallel_size", "2"), 4),
    "pp2": (("--pipeline_parallel_size", "2"), 4),
    "dp2-zero1": (("--zero_1", "true"), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_run_clm_equals_the_plain_script(ranks2, case):
    ranks2.run(script_case, *CASES[case], timeout_s=600)
