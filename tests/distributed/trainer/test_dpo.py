"""TRL's DPOTrainer on nxd_hf (nxd_hf.NxDDPOTrainer, also what nxd_hf.parallel_trainer(DPOTrainer)
returns) against plain DPOTrainer on one process, on the same preference data and seed: the loss,
grad norm, rewards (chosen, rejected, margins, accuracies), log-probabilities, logits means,
entropy and token accuracy every step and at every evaluation; the saved model / adapter loading
in plain transformers / peft. At tp=2 (the reference a frozen parallel copy), dp=2 with ZeRO-1
(each replica takes its chosen/rejected pairs) and tp=2 with LoRA (the reference: adapters
disabled); what is refused (pp, precompute_ref_log_probs, ...) is refused by name. TRL's own
trl/scripts/dpo.py with the two names swapped equals the plain script at tp=2, pp=2 and dp=2, and
examples/dpo_trl.py runs under torchrun."""

import os
import random
import tempfile

import peft
import pytest
import torch
import transformers
import trl

from support import trl_args

from support.paths import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's trainers send telemetry otherwise
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = str(REPO)
TINY = os.path.join(ROOT, "examples", "data", "tiny-llama")
WORDS = open(os.path.join(ROOT, "examples", "data", "tiny_corpus.txt")).read().split()[:400]
STEPS = trl_args.STEPS
TOL = dict(rtol=1e-5, atol=1e-6)
TRAIN_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
              "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
              "num_tokens")
EVAL_KEYS = tuple(f"eval_{k}" for k in ("loss", *TRAIN_KEYS[2:-1]))


def preferences(n: int = 22, seed: int = 5):
    """(train, eval) prompt / chosen / rejected datasets of varied lengths."""
    from datasets import Dataset

    rng = random.Random(seed)

    def sentence(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = [{"prompt": sentence(2 + i % 4), "chosen": " " + sentence(2 + i % 5), "rejected": " " + sentence(1 + i % 3)}
            for i in range(n)]
    return Dataset.from_list(rows[6:]), Dataset.from_list(rows[:6])


def model():
    return transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def common(**overrides) -> dict:
    return trl_args.common(**{"beta": 0.5, **overrides})


def run_pair(out: str, *, batch: int, lora: bool = False, given_ref: bool = False, dpo=None, **layout):
    """(plain DPOTrainer on one process, nxd_hf.parallel_trainer(DPOTrainer)) after STEPS steps."""
    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    dpo = dpo or {}
    train, evaluation = preferences()
    dp = 2 // (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1))
    ref = trl.DPOTrainer(model(), model() if given_ref else None, args=trl.DPOConfig(
        output_dir=f"{out}/ref", per_device_train_batch_size=batch * dp, **common(**trl_args.global_eval_batch(dpo, dp))),
                         train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer(),
                         peft_config=trl_args.lora_config() if lora else None)
    ref.train()
    trainer_cls, config_cls = nxd_hf.parallel_trainer(trl.DPOTrainer), nxd_hf.parallel_arguments(trl.DPOConfig)
    args = config_cls(output_dir=f"{out}/nxd", per_device_train_batch_size=batch, **common(**dpo), **layout)
    ours = trainer_cls(model(), model() if given_ref else None, args=args, train_dataset=train, eval_dataset=evaluation,
                       processing_class=tokenizer(), peft_config=trl_args.lora_config() if lora else None)
    ours.train()
    return ref, ours


def logged(history: list, key):
    return [(h["step"], h[key]) for h in history if key in h]


def check_logs(ref: list, ours: list, case) -> None:
    """The log histories of the plain run and ours: every key at every step."""
    for key in (*TRAIN_KEYS, *EVAL_KEYS):
        got, want = logged(ours, key), logged(ref, key)
        steps = list(range(1, STEPS + 1)) if key in TRAIN_KEYS else list(range(2, STEPS + 1, 2))
        assert [s for s, _ in got] == [s for s, _ in want] == steps, (case, key, got, want)
        tol = TOL
        if key == "grad_norm":  # the global norm's summation order differs (sharded vs whole tensors)
            tol = dict(rtol=1e-4, atol=1e-5)
        elif "rewards/" in key:  # beta x (policy - reference) sums of ~30 log-probs each: near-zero differences
            tol = dict(rtol=1e-5, atol=1e-5)  # of values ~40 carry their fp32 rounding, ~40 x 1.2e-7 each
        torch.testing.assert_close(torch.tensor([v for _, v in got], dtype=torch.float64),
                                   torch.tensor([v for _, v in want], dtype=torch.float64), **tol,
                                   msg=lambda m: f"{case} {key}: {m}")


def check_reference(ours, *, lora: bool, case) -> None:
    """The reference is nxd_hf's: a frozen copy sharded like the policy (its LM head a vocabulary
    shard, nxd_hf's fused head), or under LoRA the policy itself with adapters disabled."""
    from nxd_hf.integrations import dpo, fused_head
    from nxd_hf.model_state import state_of

    if lora:
        assert isinstance(ours.ref_model, dpo.AdaptersDisabled) and not list(ours.ref_model.parameters()), case
        assert ours.ref_model.policy is ours.nxd_model.hf_model, case
        return
    tp = ours.args.tensor_parallel_size
    if ours.args.pipeline_parallel_size > 1:  # the copy split into the policy's stages, run by its own schedule
        pipeline = ours.ref_model.pipeline
        assert isinstance(ours.ref_model, dpo.PipelinedReference) and not list(ours.ref_model.parameters()), case
        assert pipeline.local_stage_ids == ours.nxd_model.module.local_stage_ids, case
        assert not any(p.requires_grad for p in pipeline.parameters()), case
        policy = dict(ours.nxd_model.named_parameters())
        assert all(p.data_ptr() != policy[n].data_ptr() for n, p in pipeline.named_parameters()), case
        return
    assert state_of(ours.ref_model) is not None, case
    assert ours.ref_model.get_output_embeddings().weight.shape[0] == -(-ours.ref_model.config.vocab_size // tp), case
    assert fused_head.trl_settings(ours.ref_model) is None, case  # TRL's head (whole-vocabulary) replaced
    assert not any(p.requires_grad for p in ours.ref_model.parameters()), case
    policy = dict(ours.nxd_model.named_parameters())
    assert all(p.data_ptr() != policy[n].data_ptr() for n, p in ours.ref_model.named_parameters()), case


def check_saved(ours, directory: str, *, lora: bool, case, dpo: dict) -> None:
    """save_model's directory, opened in plain transformers / peft, evaluates (plain DPOTrainer)
    to the run's evaluation."""
    from nxd_hf import backend

    want = ours.evaluate()
    ours.save_model(directory)
    backend.barrier()
    if lora:  # merged into the base model: plain DPOTrainer would take a peft model's adapter as the reference
        plain = peft.PeftModel.from_pretrained(model(), directory)
        assert list(plain.peft_config) == ["default"], case  # the reference is the base model, not a saved adapter
        assert any("lora_B" in n for n, _ in plain.named_parameters())
        plain = plain.merge_and_unload()
    else:
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _, evaluation = preferences()
    from nxd_hf import parallel_state

    dp = parallel_state.get_data_parallel_replicas()
    args = trl.DPOConfig(output_dir=f"{directory}-eval", **common(**trl_args.global_eval_batch(dpo, dp)))
    # the reference of the plain evaluation: the untrained model (as in training)
    got = trl.DPOTrainer(plain, ref_model=model(), args=args, train_dataset=evaluation,
                         eval_dataset=evaluation, processing_class=tokenizer()).evaluate()
    for key in EVAL_KEYS:
        near_zero = 1e-5 if "rewards/" in key else 1e-6  # as in check_logs
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=near_zero), (case, key, got, want)
    backend.barrier()


def shared_dir(local: str) -> str:
    from nxd_hf import backend

    return backend.all_gather_object(local)[0]


CASES = {  # name: (per-replica batch, LoRA, ref_model given, DPOConfig overrides, layout)
    "tp2-sigmoid-sft": (4, False, False, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
                        {"tensor_parallel_size": 2}),
    # evaluation batches of 2 pairs per replica: the global ones of 4 and then 2 (of the 6 pairs)
    "dp2-zero1-accumulate-ref-model-ld-alpha": (2, False, True, {"gradient_accumulation_steps": 2, "ld_alpha": 0.5,
                                                                 "per_device_eval_batch_size": 2}, {"zero_1": True}),
    # WPO weights (use_weighting): from log_sum_sq_probs of the vocab-parallel logits
    "tp2-lora-wpo": (4, True, False, {"use_weighting": True}, {"tensor_parallel_size": 2}),
    # whole pairs per microbatch; evaluation batches of 3 pairs leave the second microbatch one padded pair
    "pp2-microbatches-ld-alpha": (4, False, False, {"ld_alpha": 0.5, "per_device_eval_batch_size": 3},
                                  {"pipeline_parallel_size": 2, "num_microbatches": 2}),
    "pp2-lora-ipo": (4, True, False, {"loss_type": ["ipo"]}, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
}


def dpo_case(name: str) -> None:
    batch, lora, given_ref, dpo, layout = CASES[name]
    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        ref, ours = run_pair(out, batch=batch, lora=lora, given_ref=given_ref, dpo=dpo, **layout)
        check_logs(ref.state.log_history, ours.state.log_history, name)
        check_reference(ours, lora=lora, case=name)
        check_saved(ours, f"{out}/final", lora=lora, case=name, dpo=dpo)


@pytest.mark.parametrize("name", list(CASES))
def test_dpo_trainer_parity(ranks2, name):
    ranks2.run(dpo_case, name, timeout_s=600)


def _write_preferences(directory: str) -> None:
    """The preference data as the dataset directory trl/scripts/dpo.py's --dataset_name loads."""
    train, evaluation = preferences()
    os.makedirs(directory, exist_ok=True)
    train.to_json(f"{directory}/train.jsonl")
    evaluation.to_json(f"{directory}/test.jsonl")


def script_case(extra: tuple, layout: tuple, batch: int) -> None:
    """TRL's own trl/scripts/dpo.py and its copy with DPOTrainer/DPOConfig swapped for nxd_hf's
    (trl_dpo_script.py) at ``layout`` (its command-line flags): the same logs every step and
    evaluation, the same saved model. ``batch``: pairs per step and rank, so that the plain run on
    one process sees the global batch (``batch`` x data-parallel ranks)."""
    import json
    from unittest import mock

    from safetensors.torch import load_file
    from trl.scripts import dpo as plain_script

    import trl_dpo_script
    from nxd_hf import backend

    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        if backend.rank() == 0:
            _write_preferences(f"{out}/data")
        backend.barrier()
        dp = 2 if "--zero_1" in layout else 1
        flags = ["--dataset_name", f"{out}/data", "--model_name_or_path", TINY, "--max_steps", str(STEPS),
                 "--learning_rate", "1e-3", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps",
                 "--save_steps", str(STEPS), "--report_to", "none", "--max_length", "24", "--beta", "0.5", "--seed", "7",
                 "--max_grad_norm", "0.5", "--warmup_steps", "1", "--disable_tqdm", "true", "--bf16", "false",
                 "--no_remove_unused_columns", *extra]
        # Trainer.end destroys the default process group: the pool's ranks run further cases on it
        with mock.patch.object(transformers.Trainer, "end", lambda self: None):
            if backend.rank() == 0:  # the plain script: one process
                plain_script.main(*plain_script.make_parser().parse_args_and_config(
                    [*flags, "--output_dir", f"{out}/plain", "--per_device_train_batch_size", str(batch * dp),
                     "--per_device_eval_batch_size", str(batch * dp)], fail_with_unknown_args=False))
            backend.barrier()
            trl_dpo_script.main(*trl_dpo_script.make_parser().parse_args_and_config(
                [*flags, "--output_dir", f"{out}/nxd", "--per_device_train_batch_size", str(batch),
                 "--per_device_eval_batch_size", str(batch), *layout], fail_with_unknown_args=False))
        backend.barrier()
        histories = []
        for run in ("plain", "nxd"):
            with open(f"{out}/{run}/checkpoint-{STEPS}/trainer_state.json") as f:
                histories.append(json.load(f)["log_history"])
        check_logs(*histories, case=f"trl/scripts/dpo.py {extra}")
        weights = "adapter_model.safetensors" if "--use_peft" in extra else "model.safetensors"
        want = load_file(f"{out}/plain/{weights}")
        if "--use_peft" in extra:
            got = load_file(f"{out}/nxd/{weights}")
            assert not os.path.exists(f"{out}/nxd/ref")  # no reference adapter: the base model is the reference
        else:
            got = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/nxd", dtype=torch.float32).state_dict()
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
        backend.barrier()


def test_trl_dpo_script_copy_changes_only_the_two_names():
    import difflib
    import inspect

    from trl.scripts import dpo as plain_script

    import trl_dpo_script

    changed = [line for line in difflib.unified_diff(inspect.getsource(plain_script).splitlines(),
                                                      inspect.getsource(trl_dpo_script).splitlines(), n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---") and line[1:].strip()]
    assert [line for line in changed if line.startswith("-")] == [
        "-    from trl import DPOTrainer, get_dataset, get_peft_config, get_quantization_config",
        "-    from trl import DatasetMixtureConfig, DPOConfig, ModelConfig, ScriptArguments, TrlParser"]
    code = [line for line in changed if line.startswith("+") and not line.lstrip("+ ").startswith(("#", "TRL", "swapped", "the original"))]
    assert code == ["+    from trl import get_dataset, get_peft_config, get_quantization_config",
                    "+    from nxd_hf import NxDDPOTrainer as DPOTrainer  # nxd_hf: the one changed line (and DPOConfig's below)",
                    "+    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser",
                    "+    from nxd_hf import NxDDPOConfig as DPOConfig  # nxd_hf: the other changed line"], code


SCRIPT_CASES = {  # id: (flags of both runs, nxd_hf's layout flags, pairs per step and rank)
    "tp2": ((), ("--tensor_parallel_size", "2"), 4),
    "tp2-use-peft": (("--use_peft", "--lora_r", "4", "--lora_alpha", "8"), ("--tensor_parallel_size", "2"), 4),
    "pp2": ((), ("--pipeline_parallel_size", "2"), 4),
    # 6 evaluation pairs: batches of 4 and 2 (global), whose per-batch means the evaluation averages
    "dp2-zero1": ((), ("--zero_1", "true"), 2),
}


@pytest.mark.parametrize("case", list(SCRIPT_CASES))
def test_trl_dpo_script_equals_the_plain_script(ranks2, case):
    ranks2.run(script_case, *SCRIPT_CASES[case], timeout_s=600)


@pytest.mark.parametrize("fields, message", [
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs"),
    ({"sync_ref_model": True}, "sync_ref_model"),
    ({"activation_offloading": True}, "activation_offloading"),
    ({"tensor_parallel_size": 2, "sequence_parallel": True}, "sequence_parallel"),
])
def test_dpo_config_refuses_what_it_cannot_do(monkeypatch, tmp_path, fields, message):
    import nxd_hf

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=f"{message}.*NxDDPOTrainer"):
        nxd_hf.NxDDPOConfig(output_dir=str(tmp_path), **fields)


def test_parallel_trainer_of_dpo_trainer_is_nxd_dpo_trainer(tmp_path):
    """parallel_trainer(DPOTrainer) used to refuse at every layout (DPOTrainer's _save_checkpoint
    and training_step are hooks nxd_hf replaces): it is NxDDPOTrainer, whose overrides all run."""
    import nxd_hf
    from nxd_hf.integrations.subclass import refused_overrides

    assert nxd_hf.parallel_trainer(trl.DPOTrainer) is nxd_hf.NxDDPOTrainer
    assert nxd_hf.parallel_arguments(trl.DPOConfig) is nxd_hf.NxDDPOConfig
    assert refused_overrides(nxd_hf.NxDDPOTrainer, pipelined=False) == []
    assert refused_overrides(nxd_hf.NxDDPOTrainer, pipelined=True) == []  # the pipelined step: dpo_pipeline
    train, _ = preferences()
    args = nxd_hf.NxDDPOConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="NxDDPOConfig"):
        nxd_hf.NxDDPOTrainer(model(), args=trl.DPOConfig(output_dir=str(tmp_path), bf16=False), train_dataset=train)
    with pytest.raises(ValueError, match="ref_model with peft_config"):
        nxd_hf.NxDDPOTrainer(model(), model(), args=args, train_dataset=train, peft_config=trl_args.lora_config())
    with pytest.raises(ValueError, match="quantization_config"):
        nxd_hf.NxDDPOTrainer(model(), args=args, train_dataset=train, quantization_config=object())
    policy = model()
    with pytest.raises(ValueError, match="cannot be the same object"):
        nxd_hf.NxDDPOTrainer(policy, policy, args=args, train_dataset=train)


def refusal_case() -> None:
    """At dp=2: a loss over the whole batch (DPO's "sft" term) would be each replica's; a last batch
    of an odd number of pairs cannot be split evenly; an already parallel ref_model cannot be
    sharded again. All refused on every rank, by name."""
    import nxd_hf

    train, _ = preferences()
    args = nxd_hf.NxDDPOConfig(output_dir="unused", **common(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0]))
    with pytest.raises(ValueError, match=r"loss_type \['sft'\] couples the rows"):
        nxd_hf.NxDDPOTrainer(model(), args=args, train_dataset=train, processing_class=tokenizer())
    args = nxd_hf.NxDDPOConfig(output_dir="unused", per_device_train_batch_size=2, **common(eval_strategy="no"))
    trainer = nxd_hf.NxDDPOTrainer(model(), args=args, train_dataset=train.select(range(15)),
                                   processing_class=tokenizer())
    with pytest.raises(ValueError, match="last batch of 3, which the 2 data-parallel replicas cannot split"):
        trainer.train()
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    args = nxd_hf.NxDDPOConfig(output_dir="unused", tensor_parallel_size=2, **common())
    parallel_ref = nxd_hf.parallelize(model(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="ref_model must be a plain Hugging Face model"):
        nxd_hf.NxDDPOTrainer(model(), parallel_ref, args=args, train_dataset=train, processing_class=tokenizer())


def test_dpo_trainer_refuses_at_dp2_what_replicas_cannot_split(ranks2):
    ranks2.run(refusal_case)


def test_example_dpo_trl(rank_pools, tmp_path):
    """examples/dpo_trl.py (capped) at tp=2 with LoRA, as torchrun starts it (on the pool's ranks):
    the reward margin grows, and the adapter it saves loads in plain peft (the example's other
    layouts: the parity cases above)."""
    import json

    from support.scripts import run_on_ranks

    out = run_on_ranks(rank_pools, "examples/dpo_trl.py", 2, "--tensor_parallel_size", "2", "--lora", "--max_steps",
                       "12", "--logging_steps", "4", "--output_dir", str(tmp_path))
    assert "reward margin" in out, out[-3000:]
    with open(tmp_path / "trainer_state.json") as f:
        margins = [h["rewards/margins"] for h in json.load(f)["log_history"] if "rewards/margins" in h]
    assert len(margins) == 3 and margins[-1] > margins[0], margins
    plain = peft.PeftModel.from_pretrained(model(), str(tmp_path / "final"))
    assert list(plain.peft_config) == ["default"]
    assert any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0 for n, p in plain.named_parameters())
