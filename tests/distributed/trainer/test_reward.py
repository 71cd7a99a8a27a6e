"""TRL's RewardTrainer on nxd_hf (nxd_hf.NxDRewardTrainer, also what
nxd_hf.parallel_trainer(RewardTrainer) returns) against plain RewardTrainer on one process, the
model given by name as TRL's reward script gives it (a sequence classifier with one label, its
head drawn after seeding), on the same preference data: the loss, grad norm, rewards (min, mean,
max), accuracy, margin and token count every step and at every evaluation, at tp=2, dp=2 with
ZeRO-1 and accumulation, and tp=2 with a margin column and centred rewards; the saved model opens
in plain transformers and evaluates (plain RewardTrainer) to the run's evaluation."""

import os
import tempfile

import pytest
import torch
import transformers
import trl

from support import trl_args
from test_dpo import TINY, preferences, shared_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's trainers send telemetry otherwise
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

STEPS = trl_args.STEPS
KEYS = ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")
TOL = dict(rtol=1e-4, atol=1e-5)


def _common(**overrides) -> dict:
    # AdamW's epsilon at 1e-6: the reward reaches the backbone through one random head at one token
    # per row, so many gradients are near zero, where Adam's first steps (g / (|g| + eps)) turn
    # fp32 rounding into whole updates; at torch's 1e-8 the tp=2 weights after 4 steps differed
    # by up to 6e-5 (also 8e-6 at dp=2, tp=1), at 1e-6 by 1.3e-6
    return {"adam_epsilon": 1e-6, **trl_args.common(**overrides)}


def _data(margin: bool):
    train, evaluation = preferences()
    if margin:  # RewardTrainer subtracts a per-pair margin inside the log-sigmoid
        train = train.add_column("margin", [0.1 * (i % 3) for i in range(len(train))])
        evaluation = evaluation.add_column("margin", [0.2] * len(evaluation))
    return train, evaluation


def _tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def _lora():
    import peft

    return peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)


def run_pair(out: str, *, batch: int, reward=None, margin: bool = False, lora: bool = False, **layout):
    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    reward = reward or {}
    train, evaluation = _data(margin)
    dp = 2 // layout.get("tensor_parallel_size", 1)
    ref = trl.RewardTrainer(TINY, trl.RewardConfig(output_dir=f"{out}/ref", per_device_train_batch_size=batch * dp,
                                                   **_common(**trl_args.global_eval_batch(reward, dp))),
                            train_dataset=train, eval_dataset=evaluation, processing_class=_tokenizer(),
                            peft_config=_lora() if lora else None)
    ref.train()
    trainer_cls, config_cls = nxd_hf.parallel_trainer(trl.RewardTrainer), nxd_hf.parallel_arguments(trl.RewardConfig)
    assert trainer_cls is nxd_hf.NxDRewardTrainer and config_cls is nxd_hf.NxDRewardConfig
    args = config_cls(output_dir=f"{out}/nxd", per_device_train_batch_size=batch, **_common(**reward), **layout)
    ours = trainer_cls(TINY, args, train_dataset=train, eval_dataset=evaluation, processing_class=_tokenizer(),
                       peft_config=_lora() if lora else None)
    ours.train()
    return ref, ours


def check_logs(ref, ours, case) -> None:
    for key in (*KEYS, *(f"eval_{k}" for k in ("loss", *KEYS[2:-1]))):
        got = [(h["step"], h[key]) for h in ours.state.log_history if key in h]
        want = [(h["step"], h[key]) for h in ref.state.log_history if key in h]
        assert [s for s, _ in got] == [s for s, _ in want] and got, (case, key, got, want)
        torch.testing.assert_close(torch.tensor([v for _, v in got], dtype=torch.float64),
                                   torch.tensor([v for _, v in want], dtype=torch.float64), **TOL,
                                   msg=lambda m: f"{case} {key}: {m}")


def check_saved(ours, directory: str, case, reward: dict) -> None:
    """save_model's directory opens in plain transformers and evaluates to the run's evaluation."""
    from nxd_hf import backend, parallel_state

    want = ours.evaluate()
    ours.save_model(directory)
    if "adapter_config.json" in os.listdir(directory):  # LoRA: the adapter with the trained head (modules_to_save)
        import peft

        base = transformers.AutoModelForSequenceClassification.from_pretrained(TINY, num_labels=1, dtype=torch.float32)
        base.config.pad_token_id = ours.model.config.pad_token_id
        plain = peft.PeftModel.from_pretrained(base, directory)
        assert any("modules_to_save" in n for n, _ in plain.named_parameters())
    else:
        plain = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32)
    dp = parallel_state.get_data_parallel_replicas()
    got = trl.RewardTrainer(plain, trl.RewardConfig(output_dir=f"{directory}-eval",
                                                    **_common(**trl_args.global_eval_batch(reward, dp))),
                            train_dataset=ours.eval_dataset, eval_dataset=ours.eval_dataset,
                            processing_class=_tokenizer()).evaluate()
    for key in ("eval_loss", "eval_accuracy", "eval_margin"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (case, key, got, want)
    backend.barrier()


CASES = {  # name: (per-replica pairs, RewardConfig overrides, margin column, LoRA, layout)
    "tp2": (4, {}, False, False, {"tensor_parallel_size": 2}),
    "dp2-zero1-accumulate": (2, {"gradient_accumulation_steps": 2}, False, False, {"zero_1": True}),
    "tp2-margin-centered": (4, {"center_rewards_coefficient": 0.01}, True, False, {"tensor_parallel_size": 2}),
    "tp2-lora": (4, {}, False, True, {"tensor_parallel_size": 2}),
}


def reward_case(name: str) -> None:
    batch, reward, margin, lora, layout = CASES[name]
    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        ref, ours = run_pair(out, batch=batch, reward=reward, margin=margin, lora=lora, **layout)
        check_logs(ref, ours, name)
        assert ours.state.total_flos == ref.state.total_flos
        check_saved(ours, f"{out}/final", name, reward)


@pytest.mark.parametrize("name", list(CASES))
def test_reward_trainer_parity(ranks2, name):
    ranks2.run(reward_case, name, timeout_s=600)


def check_refusals(out: str) -> None:
    import nxd_hf

    for fields, message in (({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                            ({"context_parallel_size": 2}, "context_parallel_size"),
                            ({"activation_offloading": True}, "activation_offloading")):
        with pytest.raises(ValueError, match=f"{message} is not supported by nxd_hf.NxDRewardTrainer"):
            nxd_hf.NxDRewardConfig(output_dir=out, report_to=[], **fields)
    with pytest.raises(ValueError, match="NxDRewardConfig"):
        nxd_hf.NxDRewardTrainer(TINY, nxd_hf.NxDTrainingArguments(output_dir=out, report_to=[]),
                                train_dataset=preferences()[0])
    # 17 pairs, 3 per replica: the last batch's 5 pairs cannot be split evenly over the 2 replicas
    args = nxd_hf.NxDRewardConfig(output_dir=out, per_device_train_batch_size=3, **_common(eval_strategy="no"))
    trainer = nxd_hf.NxDRewardTrainer(TINY, args, train_dataset=preferences(n=23)[0], processing_class=_tokenizer())
    with pytest.raises(ValueError, match="cannot split evenly"):
        trainer.get_train_dataloader()


def test_reward_trainer_refusals(ranks2, tmp_path):
    ranks2.run(check_refusals, str(tmp_path))


def test_example_reward_trl(rank_pools, tmp_path):
    """examples/reward_trl.py (capped) at tp=2 with LoRA, as torchrun starts it (on the pool's
    ranks): the loss falls, and the adapter it saves, with the trained head, loads in plain peft
    (the example's other layout: the parity cases above)."""
    import json

    import peft

    from support.scripts import run_on_ranks

    out = run_on_ranks(rank_pools, "examples/reward_trl.py", 2, "--tensor_parallel_size", "2", "--lora",
                       "--max_steps", "12", "--logging_steps", "4", "--output_dir", str(tmp_path))
    assert "accuracy" in out, out[-3000:]
    with open(tmp_path / "trainer_state.json") as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    base = transformers.AutoModelForSequenceClassification.from_pretrained(TINY, num_labels=1)
    plain = peft.PeftModel.from_pretrained(base, str(tmp_path / "final"))
    assert any("score.modules_to_save" in n for n, _ in plain.named_parameters())
