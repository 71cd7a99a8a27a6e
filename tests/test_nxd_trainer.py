"""NxDTrainer against transformers.Trainer on the single-process model: the same logged losses
and grad norms every step, the same final parameters, the same evaluation (loss and
compute_metrics) and predictions; at tp=2, pp=2 (M=4) and dp=2 with ZeRO-1 and accumulation, in
one spawn of 2 ranks."""

import tempfile

import peft
import pytest
import torch
import transformers

import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers.pad import gather_full_tensor
from nxd_hf.parallel_layers.sharding import is_sharded
from nxd_hf.testing import run_distributed

TOL = hf_parity.TOL
STEPS = 5
COMMON = dict(max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
              max_grad_norm=0.5, disable_tqdm=True, weight_decay=0.1, warmup_steps=1)


def _dataset(n=24, s=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, hf_parity.VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[: i % 4] = -100  # a different number of ignored tokens per sample
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _metrics(prediction):
    logits, labels = prediction
    return {"top1": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}


def _losses(trainer, key="loss"):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _run_case(out_dir, *, batch, accumulate=1, lora=False, **layout):
    """(reference trainer, NxDTrainer) after STEPS steps on the same weights and data."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    if lora:
        torch.manual_seed(11)  # the same adapter initialization on both sides
        reference = peft.get_peft_model(reference, _lora())
    data = _dataset()
    dp = 2 // (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1))
    ref_args = transformers.TrainingArguments(output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp,
                                              gradient_accumulation_steps=accumulate, **COMMON)
    ref = transformers.Trainer(reference, ref_args, train_dataset=data, eval_dataset=data[:6],
                               compute_metrics=_metrics)
    ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch,
                                       gradient_accumulation_steps=accumulate, **COMMON, **layout)
    torch.manual_seed(11)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data, eval_dataset=data[:6], compute_metrics=_metrics,
                             peft_config=_lora() if lora else None)
    ours.train()
    return ref, ours


def _check_training(ref, ours, case):
    for key in ("loss", "grad_norm"):
        got, want = _losses(ours, key), _losses(ref, key)
        assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, STEPS + 1)), (case, key, got)
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), **TOL,
                                   msg=lambda m: f"{case} {key}: {m}")
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.model.named_parameters()}
    checked = 0
    for name, param in ours.nxd_model.named_parameters():
        full = gather_full_tensor(param) if is_sharded(param) else param.detach()
        torch.testing.assert_close(full, ref_params[name].detach(), **TOL, msg=lambda m: f"{case} {name}: {m}")
        assert param.requires_grad == ref_params[name].requires_grad, (case, name)
        checked += 1
    assert checked > 0


def _check_evaluation(ref, ours, case):
    want, got = ref.evaluate(), ours.evaluate()  # 6 samples: under PP padded to a multiple of 4 microbatches
    for key in ("eval_loss", "eval_top1"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), (case, key, got, want)


def trainer_cases():
    with tempfile.TemporaryDirectory() as out_dir:
        ref, ours = _run_case(out_dir, batch=4, tensor_parallel_size=2)
        _check_training(ref, ours, "tp2")
        _check_evaluation(ref, ours, "tp2")
        assert "eval_top1" in ours.evaluate()  # compute_metrics saw gathered, unpadded logits
        ref, ours = _run_case(out_dir, batch=4, pipeline_parallel_size=2, num_microbatches=4)
        _check_training(ref, ours, "pp2")
        _check_evaluation(ref, ours, "pp2")
        want, got = ref.predict(_dataset()[:6]), ours.predict(_dataset()[:6])
        torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), **TOL)
        assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4)
        ref, ours = _run_case(out_dir, batch=2, accumulate=2, zero_1=True)
        _check_training(ref, ours, "dp2 zero1 accumulate2")
        ref, ours = _run_case(out_dir, batch=4, lora=True, tensor_parallel_size=2)
        _check_training(ref, ours, "tp2 lora")
        _check_evaluation(ref, ours, "tp2 lora")
        stepped = [p for group in ours.optimizer.param_groups for p in group["params"]]
        assert stepped and all(p.requires_grad for p in stepped)  # optimizer state for the adapters only
    return True


def test_nxd_trainer_matches_trainer_world2():
    assert run_distributed(trainer_cases, 2, timeout_s=600) == [True, True]


def test_arguments_refuse_what_nxd_hf_cannot_honour():
    with pytest.raises(ValueError, match="use bf16"):
        nxd_hf.NxDTrainingArguments(output_dir="/tmp/x", fp16=True, report_to=[])
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        nxd_hf.NxDTrainingArguments(output_dir="/tmp/x", label_smoothing_factor=0.1, report_to=[])
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        nxd_hf.NxDTrainingArguments(output_dir="/tmp/x", train_sampling_strategy="group_by_length", report_to=[])
    with pytest.raises(ValueError, match="positive integer"):
        nxd_hf.NxDTrainingArguments(output_dir="/tmp/x", tensor_parallel_size=0, report_to=[])
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        nxd_hf.NxDTrainingArguments(output_dir="/tmp/x", tensor_parallel_size=2, report_to=[])


def test_hf_argument_parser_exposes_the_layout():
    parser = transformers.HfArgumentParser(nxd_hf.NxDTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "/tmp/x", "--zero_1", "--num_microbatches", "4",
                                                  "--report_to", "none", "--gradient_checkpointing"])
    assert args.zero_1 and args.num_microbatches == 4 and args.nxd_activation_checkpointing
    assert not args.gradient_checkpointing  # nxd_hf checkpoints the layers itself
