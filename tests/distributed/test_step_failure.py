"""An exception on one pipeline stage during run_train/run_eval reaches every rank as the same
ValueError within seconds: no rank waits for the collective timeout."""

import time

import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.testing import run_distributed

PROMPT_S = 10  # the spread takes milliseconds; without it a peer waits for the 120 s group timeout


def _raise_in_layers_on(rank: int, message: str):
    def hook(module, args, output):
        raise RuntimeError(message)

    return hook if backend.rank() == rank else None


def _failing_step(tp: int, failing_rank: int, train: bool) -> tuple[str, float]:
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=2, num_microbatches=2)
    ids, labels = hf_parity.batch(b=4)
    pp_model.run_train(input_ids=ids, labels=labels)  # a good step first: schedules built, groups warm
    hook = _raise_in_layers_on(failing_rank, f"layer failed on purpose on rank {failing_rank}")
    if hook is not None:
        for module in pp_model.local_named_modules():
            if isinstance(module[1], transformers.models.llama.modeling_llama.LlamaDecoderLayer):
                module[1].register_forward_hook(hook)
    start = time.monotonic()
    try:
        (pp_model.run_train if train else pp_model.run_eval)(input_ids=ids, labels=labels)
    except ValueError as error:
        return str(error), time.monotonic() - start
    raise AssertionError(f"rank {backend.rank()}: the step did not fail")


def _failing_schedule_build(failing_rank: int) -> tuple[str, float]:
    """A new input shape builds a new schedule; building it fails on one rank only, while its
    peer goes on into the step."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2)
    ids, labels = hf_parity.batch(b=4)
    pp_model.run_train(input_ids=ids, labels=labels)
    if backend.rank() == failing_rank:
        def build_schedule(*args, **kwargs):
            raise RuntimeError(f"schedule failed on purpose on rank {failing_rank}")

        pp_model.build_schedule = build_schedule
    ids, labels = hf_parity.batch(b=4, s=12)
    start = time.monotonic()
    try:
        pp_model.run_train(input_ids=ids, labels=labels)
    except ValueError as error:
        return str(error), time.monotonic() - start
    raise AssertionError(f"rank {backend.rank()}: the step did not fail")


def _check_every_rank(results, failing_rank: int, what: str, failed: str = "layer") -> None:
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(f"{what} failed on rank {failing_rank} "), message
    assert f"RuntimeError: {failed} failed on purpose on rank {failing_rank}" in message, message
    assert max(elapsed for _, elapsed in results) < PROMPT_S, results


def test_last_stage_failure_pp2():
    results = run_distributed(_failing_step, 2, 1, 1, True, timeout_s=90)
    _check_every_rank(results, 1, "run_train")


def test_first_stage_failure_in_eval_pp2():
    results = run_distributed(_failing_step, 2, 1, 0, False, timeout_s=90)
    _check_every_rank(results, 0, "run_eval")


def test_one_tp_rank_of_a_stage_fails_pp2_tp2():
    results = run_distributed(_failing_step, 4, 2, 2, True, timeout_s=90)
    _check_every_rank(results, 2, "run_train")


def test_schedule_build_failure_on_one_rank_pp2():
    results = run_distributed(_failing_schedule_build, 2, 1, timeout_s=90)
    _check_every_rank(results, 1, "run_train", failed="schedule")
