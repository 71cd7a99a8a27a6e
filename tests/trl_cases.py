"""TRL's SFTTrainer against NxDSFTTrainer (tests/test_trl.py): the data, the two runs, the checks."""

import os
import random

import peft
import pytest
import torch
import transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's trainers send telemetry otherwise
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "tiny-llama")
WORDS = open(os.path.join(os.path.dirname(TINY), "tiny_corpus.txt")).read().split()[:400]
TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = 4
TRAIN_KEYS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
EVAL_KEYS = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def datasets(kind: str, n: int = 24, seed: int = 5):
    """(train, eval) datasets: "chat" (conversations through the tokenizer's chat template),
    "prompt" (prompt / completion: completion-only loss) or "text" (plain text), of varied lengths."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if kind == "chat":
            rows.append({"messages": [{"role": "user", "content": _sentence(rng, 2 + i % 4)},
                                      {"role": "assistant", "content": _sentence(rng, 3 + i % 5)}]})
        elif kind == "prompt":
            rows.append({"prompt": _sentence(rng, 2 + i % 4), "completion": " " + _sentence(rng, 3 + i % 5)})
        else:
            rows.append({"text": _sentence(rng, 4 + i % 7)})
    return Dataset.from_list(rows[6:]), Dataset.from_list(rows[:6])


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def common(**overrides) -> dict:
    return {**dict(max_steps=STEPS, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=2,
                   save_strategy="no", report_to=[], seed=7, max_grad_norm=0.5, disable_tqdm=True, warmup_steps=1,
                   bf16=False, gradient_checkpointing=False, max_length=24, per_device_eval_batch_size=4,
                   dataset_num_proc=None), **overrides}


def model():
    return transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def run_pair(out_dir: str, *, kind: str, batch: int, lora: bool = False, sft=None, **layout):
    """(plain SFTTrainer on one process, NxDSFTTrainer) after STEPS steps on the same data."""
    import trl

    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    sft = sft or {}
    train, evaluation = datasets(kind)
    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    dp = 2 // (tp * pp)
    ref = trl.SFTTrainer(model(), trl.SFTConfig(output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp,
                                                **common(**sft)),
                         train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer(),
                         peft_config=lora_config() if lora else None)
    ref.train()
    args = nxd_hf.NxDSFTConfig(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch, **common(**sft),
                               **layout)
    ours = nxd_hf.NxDSFTTrainer(model(), args, train_dataset=train, eval_dataset=evaluation,
                                processing_class=tokenizer(), peft_config=lora_config() if lora else None)
    ours.train()
    return ref, ours


def logged(trainer, key):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def check_logs(ref, ours, case) -> None:
    for key in (*TRAIN_KEYS, *EVAL_KEYS):
        got, want = logged(ours, key), logged(ref, key)
        steps = list(range(1, STEPS + 1)) if key in TRAIN_KEYS else list(range(2, STEPS + 1, 2))
        assert [s for s, _ in got] == [s for s, _ in want] == steps, (case, key, got, want)
        torch.testing.assert_close(torch.tensor([v for _, v in got], dtype=torch.float64),
                                   torch.tensor([v for _, v in want], dtype=torch.float64), **TOL,
                                   msg=lambda m: f"{case} {key}: {m}")


def check_saved(ours, directory: str, *, kind: str, lora: bool, case, sft=None) -> None:
    """save_model's directory, opened in plain transformers / peft, evaluates (plain SFTTrainer)
    to the run's eval loss."""
    import trl

    from nxd_hf import backend

    want = ours.evaluate()
    ours.save_model(directory)
    if lora:
        plain = peft.PeftModel.from_pretrained(model(), directory)
        assert any("lora_B" in n for n, _ in plain.named_parameters())
    else:
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _, evaluation = datasets(kind)
    args = trl.SFTConfig(output_dir=f"{directory}-eval", **common(**(sft or {})))
    got = trl.SFTTrainer(plain, args, train_dataset=evaluation, eval_dataset=evaluation,
                         processing_class=tokenizer()).evaluate()
    for key in EVAL_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-4), (case, key, got, want)
    backend.barrier()


def shared_dir(local: str) -> str:
    """Rank 0's directory, the same on every rank."""
    from nxd_hf import backend

    return backend.all_gather_object(local)[0]


def _token_rows(n=16, s=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    vocab = model().config.vocab_size
    rows = []
    for i in range(n):
        ids = torch.randint(0, vocab, (s,), generator=g)
        labels = ids.clone()
        labels[: i % 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def run_trainer_pair(trainer_cls, *, reference: bool = True, **layout):
    """(trainer_cls on one process, nxd_hf.parallel_trainer(trainer_cls)) after STEPS steps."""
    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    rows = _token_rows()
    kwargs = dict(max_steps=STEPS, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=2,
                  save_strategy="no", report_to=[], seed=7, max_grad_norm=0.5, disable_tqdm=True,
                  per_device_train_batch_size=4)
    ref = None
    if reference:
        ref = trainer_cls(model(), transformers.TrainingArguments(output_dir="unused", **kwargs), train_dataset=rows,
                          eval_dataset=rows[:4])
        ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir="unused", **kwargs, **layout)
    ours = nxd_hf.parallel_trainer(trainer_cls)(model(), args, train_dataset=rows, eval_dataset=rows[:4])
    ours.train()
    return ref, ours
