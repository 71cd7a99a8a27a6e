"""TRL's own trl/scripts/sft.py and reward.py, and their copies with the trainer and its config
swapped for nxd_hf's (trl_sft_script.py, trl_reward_script.py: the only change) on the same data:
every logged value at every step and evaluation, and the saved model or adapter, equal the plain
script's on one process — sft.py at tp=2 (with LoRA, with packing), pp=2 and dp=2 with ZeRO-1,
reward.py at tp=2 (with LoRA) and dp=2 with ZeRO-1. The scripts pass the model by name, as TRL's
trainers take it."""

import difflib
import importlib
import inspect
import json
import os
import tempfile
from unittest import mock

import pytest
import torch
import transformers

from support import trl_args
from test_dpo import preferences
from test_trl import TINY, datasets, shared_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's trainers send telemetry otherwise
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

STEPS = trl_args.STEPS
UNCOMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
              "eval_samples_per_second", "eval_steps_per_second"}


def _write_data(directory: str, kind: str) -> None:
    """The dataset as the directory the script's --dataset_name loads (train and test splits)."""
    train, evaluation = preferences() if kind == "preferences" else datasets(kind)
    os.makedirs(directory, exist_ok=True)
    train.to_json(f"{directory}/train.jsonl")
    evaluation.to_json(f"{directory}/test.jsonl")


# script: (plain module, its copy, the swapped names as plain TRL and nxd_hf spell them, the saved model's class)
SCRIPTS = {
    "sft": ("trl.scripts.sft", "trl_sft_script", ("SFTTrainer", "SFTConfig"), ("NxDSFTTrainer", "NxDSFTConfig"),
            transformers.AutoModelForCausalLM),
    "reward": ("trl.scripts.reward", "trl_reward_script", ("RewardTrainer", "RewardConfig"),
               ("NxDRewardTrainer", "NxDRewardConfig"), transformers.AutoModelForSequenceClassification),
}


def script_case(name: str, kind: str, extra: tuple, layout: tuple, batch: int) -> None:
    """TRL's script ``name`` and its copy on ``kind`` data with ``extra`` flags, ours at
    ``layout``; ``batch``: rows (or pairs) per step and replica (the plain run on one process
    takes the global batch)."""
    from safetensors.torch import load_file

    from nxd_hf import backend

    plain_script, copy_script = (importlib.import_module(m) for m in SCRIPTS[name][:2])

    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        if backend.rank() == 0:
            _write_data(f"{out}/data", kind)
        backend.barrier()
        dp = 2 if "--zero_1" in layout else 1
        flags = ["--dataset_name", f"{out}/data", "--model_name_or_path", TINY, "--max_steps", str(STEPS),
                 "--learning_rate", "1e-3", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2",
                 "--save_strategy", "steps", "--save_steps", str(STEPS), "--report_to", "none", "--max_length", "24",
                 "--seed", "7", "--max_grad_norm", "0.5", "--warmup_steps", "1", "--disable_tqdm", "true",
                 "--bf16", "false", *extra]
        runs = ((plain_script, "plain", batch * dp, ()), (copy_script, "nxd", batch, layout))
        # Trainer.end destroys the default process group: the pool's ranks run further cases on it
        with mock.patch.object(transformers.Trainer, "end", lambda self: None):
            for script, run, rows, parallel in runs:
                if run == "nxd" or backend.rank() == 0:  # the plain script: one process
                    script.main(*script.make_parser().parse_args_and_config(
                        [*flags, "--output_dir", f"{out}/{run}", "--per_device_train_batch_size", str(rows),
                         "--per_device_eval_batch_size", str(rows), *parallel], fail_with_unknown_args=False))
                backend.barrier()
        case = f"trl/scripts/{name}.py {kind} {extra} {layout}"
        histories = []
        for run in ("plain", "nxd"):
            with open(f"{out}/{run}/checkpoint-{STEPS}/trainer_state.json") as f:
                histories.append(json.load(f)["log_history"])
        _check_logs(*histories, case=case)
        lora = "--use_peft" in extra
        weights = "adapter_model.safetensors" if lora else "model.safetensors"
        want = load_file(f"{out}/plain/{weights}")
        got = load_file(f"{out}/nxd/{weights}") if lora else SCRIPTS[name][4].from_pretrained(
            f"{out}/nxd", dtype=torch.float32).state_dict()
        assert set(want) <= set(got), (case, sorted(set(want) - set(got)))
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{case} {key}: {m}")
        backend.barrier()


def _check_logs(want_logs: list, got_logs: list, case: str) -> None:
    assert len(want_logs) == len(got_logs) == STEPS + STEPS // 2, (case, want_logs, got_logs)  # steps, evaluations
    for want, got in zip(want_logs, got_logs):
        assert set(want) == set(got), (case, sorted(set(want) ^ set(got)))
        for key in set(want) - UNCOMPARED:
            if isinstance(want[key], float):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (case, key, want, got)
            else:
                assert got[key] == want[key], (case, key, want, got)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_trl_script_copy_changes_only_the_two_names(name):
    module, copied, (trainer, config), (nxd_trainer, nxd_config), _ = SCRIPTS[name]
    changed = [line for line in difflib.unified_diff(inspect.getsource(importlib.import_module(module)).splitlines(),
                                                      inspect.getsource(importlib.import_module(copied)).splitlines(),
                                                      n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---") and line[1:].strip()]
    trl_lines = [line for line in changed if line.startswith("-")]
    assert len(trl_lines) == 2 and f"{trainer}, " in trl_lines[0] and f", {config}, " in trl_lines[1], trl_lines
    code = [line for line in changed if line.startswith("+")
            and not line.lstrip("+ ").startswith(("#", "TRL", "swapped", "that it", "differs", "RewardConfig swapped"))]
    assert code == [trl_lines[0].replace(f"{trainer}, ", "").replace("-", "+", 1),
                    f"+    from nxd_hf import {nxd_trainer} as {trainer}  # nxd_hf: the one changed line (and "
                    f"{config}'s below)",
                    trl_lines[1].replace(f", {config}", "").replace("-", "+", 1),
                    f"+    from nxd_hf import {nxd_config} as {config}  # nxd_hf: the other changed line"], code


SCRIPT_CASES = {  # id: (script, data, flags of both runs, nxd_hf's layout flags, rows per step and replica)
    "sft-tp2-chat": ("sft", "chat", (), ("--tensor_parallel_size", "2"), 4),
    "sft-tp2-use-peft": ("sft", "chat", ("--use_peft", "--lora_r", "4", "--lora_alpha", "8"),
                         ("--tensor_parallel_size", "2"), 4),
    "sft-tp2-packing": ("sft", "text", ("--packing",), ("--tensor_parallel_size", "2"), 2),
    "sft-pp2-text": ("sft", "text", (), ("--pipeline_parallel_size", "2"), 4),
    "sft-dp2-zero1-chat": ("sft", "chat", (), ("--zero_1", "true"), 2),
    # AdamW's epsilon 1e-6 for the reward model: why in test_reward.py (near-zero gradients)
    "reward-tp2": ("reward", "preferences", ("--adam_epsilon", "1e-6"), ("--tensor_parallel_size", "2"), 4),
    "reward-tp2-use-peft": ("reward", "preferences", ("--adam_epsilon", "1e-6", "--use_peft", "--lora_r", "4",
                                                      "--lora_alpha", "8", "--lora_task_type", "SEQ_CLS"),
                            ("--tensor_parallel_size", "2"), 4),
    "reward-dp2-zero1": ("reward", "preferences", ("--adam_epsilon", "1e-6"), ("--zero_1", "true"), 2),
}


@pytest.mark.parametrize("case", list(SCRIPT_CASES))
def test_trl_script_equals_the_plain_script(ranks2, case):
    ranks2.run(script_case, *SCRIPT_CASES[case], timeout_s=600)


def test_a_model_by_name_loads_on_the_cpu_for_nxd_hf_to_place(monkeypatch):
    """TRL loads a named model with device_map="auto" where the process has a GPU, which would
    spread every rank's whole copy over its GPUs; nxd_hf loads it on the CPU and places the shards."""
    import trl.trainer.utils

    import nxd_hf
    from nxd_hf.integrations.model_path import load_named_model

    args = nxd_hf.NxDSFTConfig(output_dir="unused", model_init_kwargs={"dtype": "bfloat16"}, report_to=[])
    kwargs = {}
    model = load_named_model(TINY, args, kwargs, trainer="NxDSFTTrainer")
    assert model.dtype == torch.bfloat16 and args.model_init_kwargs is None  # honoured, then used
    assert kwargs == {}  # no revision: SFTTrainer loads the tokenizer as for a model object
    seen = {}
    monkeypatch.setattr(trl.trainer.utils, "create_model_from_path",
                        lambda model_id, architecture=None, **kw: seen.update(kw))
    load_named_model(TINY, nxd_hf.NxDSFTConfig(output_dir="unused", report_to=[]), {}, trainer="NxDSFTTrainer")
    assert seen == {"device_map": None, "trust_remote_code": False}
    with pytest.raises(ValueError, match="quantization_config is not supported by nxd_hf's NxDSFTTrainer"):
        load_named_model(TINY, args, {}, trainer="NxDSFTTrainer", quantization_config=object())
