"""NxDTrainer against transformers.Trainer on the single-process model: the same logged losses
and grad norms every step, the same final parameters, the same evaluation (loss and
compute_metrics) and predictions; at tp=2, pp=2 (M=4) and dp=2 with ZeRO-1 and accumulation, in
one spawn of 2 ranks."""

import contextlib
import json
import os
import shutil
import tempfile
from unittest import mock

import peft
import pytest
import torch
import transformers
from accelerate.state import PartialState
from accelerate.utils import DistributedType

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor
from support import hf_parity


def one_process_reference_args(**kwargs) -> transformers.TrainingArguments:
    hidden = {name: os.environ.pop(name) for name in ("LOCAL_RANK",) if name in os.environ}
    try:  # without LOCAL_RANK accelerate sees a plain `python script.py` run: no distribution
        return transformers.TrainingArguments(**kwargs)
    finally:
        os.environ.update(hidden)


@contextlib.contextmanager
def accelerate_infers_gpus():
    inferred = PartialState._prepare_backend

    def as_on_a_gpu(self, cpu=False, sagemaker_dp=False, backend_name=None):
        if int(os.environ.get("LOCAL_RANK", -1)) != -1 and not cpu:  # accelerate's branch for CUDA
            return backend_name or "nccl", DistributedType.MULTI_GPU
        return inferred(self, cpu, sagemaker_dp, backend_name)

    device = str(backend.default_device())  # PartialState.set_device would pick cuda:LOCAL_RANK
    with mock.patch.object(PartialState, "_prepare_backend", as_on_a_gpu), \
            mock.patch.dict(os.environ, {"ACCELERATE_TORCH_DEVICE": device}):
        yield


TOL = hf_parity.TOL
STEPS = 5
COMMON = dict(max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
              max_grad_norm=0.5, disable_tqdm=True, weight_decay=0.1, warmup_steps=1)


def _dataset(n=24, s=8, seed=3, *, uniform=False):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, hf_parity.VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[: 1 if uniform else i % 4] = -100  # a different number of ignored tokens per sample (or not)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _metrics(prediction):
    logits, labels = prediction
    return {"top1": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}


def _losses(trainer, key="loss"):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _run_case(out_dir, *, batch, accumulate=1, lora=False, trainer_cls=nxd_hf.NxDTrainer, samples=24,
              mean_loss=False, both=None, ref_cls=transformers.Trainer, model_type="llama", **layout):
    """(reference trainer, NxDTrainer) after STEPS steps on the same weights and data. ``samples``
    not a multiple of the global batch: each epoch ends on a short batch. ``mean_loss``: models
    whose loss is a per-batch mean (``accepts_loss_kwargs=False``), on samples of equal token counts.
    ``both``: arguments of both trainers; ``ref_cls``: the reference's trainer class."""
    common = {**COMMON, **(both or {})}
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type, **({"num_hidden_layers": 4} if model_type != "llama" else {}))
    if mean_loss:
        reference.accepts_loss_kwargs = model.accepts_loss_kwargs = False
    if lora:
        torch.manual_seed(11)  # the same adapter initialization on both sides
        reference = peft.get_peft_model(reference, _lora())
    data = _dataset(samples, uniform=mean_loss)
    dp = torch.distributed.get_world_size() // (layout.get("tensor_parallel_size", 1)
                                                * layout.get("pipeline_parallel_size", 1))
    ref_args = one_process_reference_args(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp, gradient_accumulation_steps=accumulate,
        **common)
    ref = ref_cls(reference, ref_args, train_dataset=data, eval_dataset=data[:6], compute_metrics=_metrics)
    ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch,
                                       gradient_accumulation_steps=accumulate, **common, **layout)
    torch.manual_seed(11)
    ours = trainer_cls(model, args, train_dataset=data, eval_dataset=data[:6], compute_metrics=_metrics,
                             peft_config=_lora() if lora else None)
    ours.train()
    return ref, ours


def _check_training(ref, ours, case):
    for key in ("loss", "grad_norm"):
        got, want = _losses(ours, key), _losses(ref, key)
        assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, STEPS + 1)), (case, key, got)
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), **TOL,
                                   msg=lambda m: f"{case} {key}: {m}")
    # Trainer's 6 x tokens x non-embedding parameters: of the unparallelized model and the global batch
    assert ours.state.total_flos == ref.state.total_flos > 0, (case, ours.state.total_flos, ref.state.total_flos)
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.model.named_parameters(remove_duplicate=False)}
    checked = 0
    for name, param in ours.nxd_model.named_parameters():
        full = full_tensor(param).t() if getattr(param, "hf_transposed", False) else full_tensor(param)  # Conv1D
        torch.testing.assert_close(full, ref_params[name].detach(), **TOL, msg=lambda m: f"{case} {name}: {m}")
        assert param.requires_grad == ref_params[name].requires_grad, (case, name)
        checked += 1
    assert checked > 0


def _check_evaluation(ref, ours, case):
    want, got = ref.evaluate(), ours.evaluate()  # 6 samples: under PP padded to a multiple of 4 microbatches
    for key in ("eval_loss", "eval_top1"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), (case, key, got, want)


def _train_nxd(out_dir, *, steps, resume=None, lora=False, batch=4, **layout):
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch,
                                       **{**COMMON, "max_steps": steps, "save_strategy": "steps", "save_steps": 2,
                                          "save_total_limit": 2}, **layout)
    torch.manual_seed(11)
    trainer = nxd_hf.NxDTrainer(model, args, train_dataset=_dataset(), peft_config=_lora() if lora else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _check_saved_model(trainer, directory, lora):
    """save_model's directory opens in plain transformers / peft with our logits."""
    device = backend.default_device()  # where NxDTrainer put the model (the GPU in the cuda lane)
    ids = torch.stack([row["input_ids"] for row in _dataset()[:3]]).to(device)
    trainer.nxd_model.eval()
    with torch.no_grad():
        ours = trainer.nxd_model(input_ids=ids).logits
    if lora:
        base, _ = hf_parity.build_pair("llama")
        plain = peft.PeftModel.from_pretrained(base, directory)
    else:
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
    plain.to(device)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(input_ids=ids).logits, ours, **TOL)


def check_checkpoints_and_resume(out_dir):
    """save_steps checkpoints, save_model, exact resume at the same sizes, resume at other sizes."""
    whole = _train_nxd(f"{out_dir}/a", steps=6, tensor_parallel_size=2)
    whole.save_model(f"{out_dir}/final")  # (while parallel_state is still tp=2)
    _check_saved_model(whole, f"{out_dir}/final", lora=False)
    names = sorted(os.listdir(f"{out_dir}/a"))
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"], names
    assert transformers.trainer_utils.get_last_checkpoint(f"{out_dir}/a").endswith("checkpoint-6")
    backend.barrier()
    if backend.rank() == 0:
        shutil.copytree(f"{out_dir}/a/checkpoint-4", f"{out_dir}/b/checkpoint-4")
    backend.barrier()
    resumed = _train_nxd(f"{out_dir}/b", steps=6, resume=True, tensor_parallel_size=2)
    assert _losses(resumed)[-2:] == _losses(whole)[-2:]  # bitwise
    for (name, p), q in zip(whole.nxd_model.named_parameters(), resumed.nxd_model.parameters()):
        assert torch.equal(p, q), name
    other = _train_nxd(f"{out_dir}/c", steps=6, resume=f"{out_dir}/a/checkpoint-4", batch=2)  # tp=1 x dp=2
    torch.testing.assert_close(torch.tensor([v for _, v in _losses(other)[-2:]]),
                               torch.tensor([v for _, v in _losses(whole)[-2:]]), **TOL)


def check_lora_save_model(out_dir):
    lora = _train_nxd(f"{out_dir}/d", steps=2, lora=True, tensor_parallel_size=2)
    lora.save_model(f"{out_dir}/adapter")
    assert os.path.exists(f"{out_dir}/adapter/adapter_model.safetensors")
    _check_saved_model(lora, f"{out_dir}/adapter", lora=True)


def check_layout_mismatch(out_dir):
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, tensor_parallel_size=1, **COMMON)
    with pytest.raises(ValueError, match="parallelized with tp=2, pp=1 but the arguments ask for tp=1, pp=1"):
        nxd_hf.NxDTrainer(model, args, train_dataset=_dataset())


SAVING_CASES = {
    "save_steps_checkpoints_resume_exactly_and_at_other_sizes": check_checkpoints_and_resume,
    "lora_save_model_writes_a_peft_adapter": check_lora_save_model,
    "model_parallelized_at_another_layout_than_the_arguments_is_refused": check_layout_mismatch,
}


@pytest.mark.parametrize("case", list(SAVING_CASES))
def test_checkpoints_and_saving(ranks2, tmp_path, case):
    ranks2.run(SAVING_CASES[case], str(tmp_path))


def check_matches_trainer(layout: str) -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        if layout == "tp2":
            ref, ours = _run_case(out_dir, batch=4, tensor_parallel_size=2)
            _check_training(ref, ours, "tp2")
            _check_evaluation(ref, ours, "tp2")
            assert "eval_top1" in ours.evaluate()  # compute_metrics saw gathered, unpadded logits
        elif layout == "pp2":
            ref, ours = _run_case(out_dir, batch=4, pipeline_parallel_size=2, num_microbatches=4)
            _check_training(ref, ours, "pp2")
            _check_evaluation(ref, ours, "pp2")
            want, got = ref.predict(_dataset()[:6]), ours.predict(_dataset()[:6])
            torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), **TOL)
            assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4)
        elif layout == "dp2_zero1_accumulate2":
            ref, ours = _run_case(out_dir, batch=2, accumulate=2, zero_1=True)
            _check_training(ref, ours, "dp2 zero1 accumulate2")
            # per_device_eval_batch_size rows per replica, as the train batch: batches of 4 and 2 of
            # the 6 samples, whose token-mean losses evaluation_loop weighs by the batch size
            ref.args.per_device_eval_batch_size, ours.args.per_device_eval_batch_size = 4, 2
            _check_evaluation(ref, ours, "dp2 zero1 accumulate2, evaluation batches of 2 per replica")
            ref.args.per_device_eval_batch_size = 2
            assert ref.evaluate()["eval_loss"] != pytest.approx(ours.evaluate()["eval_loss"], rel=1e-4)  # it matters
        elif layout == "dp2_short_last_batch":  # 5 samples, global batch 4: a batch of 1 leaves a replica no row
            for case in (dict(), dict(zero_1=True), dict(mean_loss=True, accumulate=2)):
                ref, ours = _run_case(out_dir, batch=2, samples=5, **case)
                _check_training(ref, ours, f"dp2 short last batch {case}")
        elif layout == "pp2_short_last_batch":  # batches of 4 and 1: the 1 is padded to num_microbatches=2
            ref, ours = _run_case(out_dir, batch=4, samples=5, pipeline_parallel_size=2, num_microbatches=2)
            _check_training(ref, ours, "pp2 M=2 short last batch")
            _check_evaluation(ref, ours, "pp2 M=2 short last batch")
        elif layout == "label_smoothing":  # Trainer's LabelSmoother on the full logits, ours in the parallel loss
            smoothing = dict(label_smoothing_factor=0.1)
            for name, case in (("tp2 fused loss", dict(batch=4, tensor_parallel_size=2, fused_loss=True)),
                               ("pp2 M=4", dict(batch=4, pipeline_parallel_size=2, num_microbatches=4)),
                               ("dp2 zero1 accumulate2", dict(batch=2, accumulate=2, zero_1=True))):
                ref, ours = _run_case(out_dir, both=smoothing, **case)
                _check_training(ref, ours, f"label smoothing {name}")
                _check_evaluation(ref, ours, f"label smoothing {name}")  # eval: the smoother on both sides
            ref, plain = _run_case(out_dir, batch=4, tensor_parallel_size=2)
            assert _losses(plain)[0][1] != pytest.approx(_losses(ours)[0][1], rel=1e-3)  # it did smooth
        else:
            assert layout == "tp2_lora"
            ref, ours = _run_case(out_dir, batch=4, lora=True, tensor_parallel_size=2)
            _check_training(ref, ours, "tp2 lora")
            _check_evaluation(ref, ours, "tp2 lora")
            stepped = [p for group in ours.optimizer.param_groups for p in group["params"]]
            assert stepped and all(p.requires_grad for p in stepped)  # optimizer state for the adapters only


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_zero1_accumulate2", "tp2_lora", "dp2_short_last_batch",
                                    "pp2_short_last_batch", "label_smoothing"])
def test_nxd_trainer_matches_trainer(ranks2, layout):
    ranks2.run(check_matches_trainer, layout)


def check_tied_embeddings_world4() -> None:
    """Tied heads (a pipeline's last stage holds the embedding's copy), GPT-2's Conv1D and position
    embedding, at layouts of 4 ranks: the training and ``total_flos`` of Trainer on one process."""
    with tempfile.TemporaryDirectory() as out_dir:
        for model_type, layout in (("qwen2", dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                  num_microbatches=2)),
                                   ("gpt2", dict(tensor_parallel_size=4)),
                                   ("qwen2", dict(tensor_parallel_size=2, zero_1=True))):
            dp = 4 // (layout["tensor_parallel_size"] * layout.get("pipeline_parallel_size", 1))
            ref, ours = _run_case(out_dir, batch=4 // dp, model_type=model_type, **layout)  # global batch 4
            _check_training(ref, ours, f"{model_type} {layout}")


def test_tied_embeddings_world4(ranks4):
    ranks4.run(check_tied_embeddings_world4)


def check_matches_trainer_where_accelerate_infers_gpus(layout: str) -> None:
    """Under torchrun with a GPU accelerate infers MULTI_GPU, where its loaders shard by process;
    NxDTrainer's batches (train, evaluate, predict) must not depend on that."""
    with accelerate_infers_gpus():
        if layout != "tp2_evaluate_after_a_plain_trainer":
            return check_matches_trainer(layout)
        with tempfile.TemporaryDirectory() as out_dir:  # a Trainer built later re-infers accelerate's shared state
            parallel_state.destroy_model_parallel()
            _, model = hf_parity.build_pair("llama")
            args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, tensor_parallel_size=2, **COMMON)
            ours = nxd_hf.NxDTrainer(model, args, eval_dataset=_dataset()[:6])
            before = ours.evaluate()["eval_loss"]
            transformers.Trainer(hf_parity.build_pair("llama")[0],
                                 transformers.TrainingArguments(output_dir=f"{out_dir}/plain", report_to=[]))
            assert ours.evaluate()["eval_loss"] == before


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_zero1_accumulate2", "tp2_evaluate_after_a_plain_trainer"])
def test_nxd_trainer_matches_trainer_where_accelerate_infers_gpus(ranks2, layout):
    ranks2.run(check_matches_trainer_where_accelerate_infers_gpus, layout)


def _classification_dataset(n=24, s=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        mask = torch.ones(s, dtype=torch.long)
        mask[s - i % 3:] = 0  # padded sequences: the pooler reads position 0, attention skips the padding
        rows.append({"input_ids": torch.randint(0, hf_parity.VOCAB, (s,), generator=g), "attention_mask": mask,
                     "labels": torch.tensor(i % 3)})
    return rows


def check_sequence_classification(layout: str, out_dir: str) -> None:
    """BertForSequenceClassification as transformers' run_classification.py trains it: the same losses,
    grad norms and weights, evaluation and predictions (7 rows: padded to the microbatches under PP),
    and a saved model whose config names the classification head."""
    sizes = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
             "dp2_zero1_accumulate2": dict(zero_1=True)}[layout]
    batch, accumulate = (2, 2) if layout.startswith("dp2") else (4, 1)
    dp = 2 // (sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1))
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertForSequenceClassification)
    reference.config.architectures = model.config.architectures = ["BertModel"]  # as a hub base model's config
    data, held_out = _classification_dataset(), _classification_dataset(7, seed=6)
    ref_args = one_process_reference_args(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp, gradient_accumulation_steps=accumulate,
        **COMMON)
    ref = transformers.Trainer(reference, ref_args, train_dataset=data, eval_dataset=held_out)
    ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch,
                                       gradient_accumulation_steps=accumulate, **COMMON, **sizes)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data, eval_dataset=held_out)
    ours.train()
    _check_training(ref, ours, f"classification {layout}")
    want, got = ref.predict(held_out), ours.predict(held_out)
    torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), **TOL)
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4), (got, want)
    ours.save_model(f"{out_dir}/final")
    if backend.rank() == 0:
        ref.save_model(f"{out_dir}/plain")
        with open(f"{out_dir}/final/config.json") as f, open(f"{out_dir}/plain/config.json") as g:
            assert json.load(f)["architectures"] == json.load(g)["architectures"] == [
                "BertForSequenceClassification"]
    backend.barrier()


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_zero1_accumulate2"])
def test_sequence_classification_matches_trainer(ranks2, tmp_path, layout):
    ranks2.run(check_sequence_classification, layout, str(tmp_path))


class _WeightedLoss:
    """A user's ``compute_loss`` as written for ``Trainer``: the loss weighted by 1.5 (linear in
    it, so one process and any data-parallel split give the same step)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss * 1.5
        return (loss, outputs) if return_outputs else loss


class _OwnLossTrainer(_WeightedLoss, nxd_hf.NxDTrainer):
    pass


class _PlainOwnLossTrainer(_WeightedLoss, transformers.Trainer):
    pass


def check_subclass_compute_loss(out_dir: str) -> None:
    """``class MyTrainer(NxDTrainer)`` with its own ``compute_loss``: trained and evaluated with it,
    as ``Trainer`` would (at tp=2 and dp=2 with accumulation); refused under PP, where it could
    not run."""
    for name, case in (("tp2", dict(batch=4, tensor_parallel_size=2)),
                       ("dp2 accumulate2", dict(batch=2, accumulate=2))):
        ref, ours = _run_case(out_dir, trainer_cls=_OwnLossTrainer, ref_cls=_PlainOwnLossTrainer, **case)
        _check_training(ref, ours, f"own compute_loss {name}")
        _check_evaluation(ref, ours, f"own compute_loss {name}")
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, pipeline_parallel_size=2,
                                       **COMMON)
    with pytest.raises(ValueError, match=r"_OwnLossTrainer overrides .*_WeightedLoss.compute_loss, which run the "
                                         r"model; under pipeline parallelism"):
        _OwnLossTrainer(model, args)


def test_subclass_compute_loss_runs_as_under_trainer(ranks2, tmp_path):
    ranks2.run(check_subclass_compute_loss, str(tmp_path))


def check_label_smoothing_refusals(out_dir: str) -> None:
    """label_smoothing_factor where NxDTrainer cannot give Trainer's numbers: a model whose loss is
    not nxd_hf's causal-LM loss, a model that adds the router's auxiliary loss (which Trainer's
    smoother drops)."""
    args = dict(output_dir=out_dir, per_device_train_batch_size=2, label_smoothing_factor=0.1, **COMMON)
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertForSequenceClassification)
    with pytest.raises(ValueError, match="BertForSequenceClassification computes another loss"):
        nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(tensor_parallel_size=2, **args))
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="drops the router's auxiliary loss"):
        nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(tensor_parallel_size=2, **args))
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")


def test_label_smoothing_refused_where_it_cannot_apply(ranks2, tmp_path):
    ranks2.run(check_label_smoothing_refusals, str(tmp_path))


class _CountingTrainer(nxd_hf.NxDTrainer):
    """Records, per micro-step, whether it ends an accumulation and the bytes of gradients it sent over DP."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        dp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
        with backend.count_comm() as records:
            loss = super().training_step(model, inputs, num_items_in_batch)
        grad_bytes = sum(r.payload_bytes for r in records if r.ranks == dp_ranks and r.payload_bytes > 8)
        self.micro_steps = [*getattr(self, "micro_steps", []), (self.accelerator.sync_gradients, grad_bytes)]
        return loss


def check_overlap_on_off(zero1: bool) -> None:
    """dp=2, accumulation 2: with overlap_grad_reduce the gradients (ZeRO-1: reduce-scatter) cross DP in the
    last micro-step's backward only, and training equals transformers.Trainer and the run without overlap."""
    runs = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for overlap in (True, False):
            ref, ours = _run_case(out_dir, batch=2, accumulate=2, zero_1=zero1, overlap_grad_reduce=overlap,
                                  trainer_cls=_CountingTrainer)
            _check_training(ref, ours, f"dp2 accumulate2 zero1={zero1} overlap={overlap}")
            assert [sync for sync, _ in ours.micro_steps] == [False, True] * STEPS
            sent = [grad_bytes > 0 for sync, grad_bytes in ours.micro_steps]
            assert sent == ([False, True] * STEPS if overlap else [False] * 2 * STEPS), ours.micro_steps
            runs[overlap] = {n: full_tensor(p) for n, p in ours.nxd_model.named_parameters()}
    for name, value in runs[True].items():
        torch.testing.assert_close(value, runs[False][name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("zero1", [False, True])
def test_overlap_on_off_dp2_accumulate2(ranks2, zero1):
    ranks2.run(check_overlap_on_off, zero1)


def test_arguments_refuse_what_nxd_hf_cannot_honour():
    with pytest.raises(ValueError, match="use bf16"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", fp16=True, report_to=[])
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", train_sampling_strategy="group_by_length", report_to=[])
    with pytest.raises(ValueError, match="positive integer"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", tensor_parallel_size=0, report_to=[])
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", tensor_parallel_size=2, report_to=[])


def test_hf_argument_parser_exposes_the_layout():
    parser = transformers.HfArgumentParser(nxd_hf.NxDTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "unused", "--zero_1", "--num_microbatches", "4",
                                                  "--report_to", "none", "--gradient_checkpointing"])
    assert args.zero_1 and args.num_microbatches == 4 and args.nxd_activation_checkpointing
    assert not args.gradient_checkpointing  # nxd_hf checkpoints the layers itself


def test_model_init(tmp_path):
    """model_init's model is parallelized as the arguments say (tp=1 in this process)."""
    parallel_state.destroy_model_parallel()
    args = nxd_hf.NxDTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                       **{**COMMON, "max_steps": 2})
    trainer = nxd_hf.NxDTrainer(args=args, train_dataset=_dataset(), model_init=lambda: hf_parity.build_pair("llama")[1])
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.model.nxd.tp_size == 1
    parallel_state.destroy_model_parallel()
