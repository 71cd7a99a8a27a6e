"""TRL's SFTTrainer on nxd_hf (nxd_hf.NxDSFTTrainer) against plain SFTTrainer on one process, on
the same data and seed: training loss, grad norm and SFT metrics (entropy, mean_token_accuracy,
num_tokens) every step, eval loss and metrics at every eval step, and the saved model / adapter
evaluating in plain transformers / peft to the run's eval loss; at tp=2, pp=2 (2 microbatches),
dp=2 with ZeRO-1 and accumulation, tp=2 with LoRA (peft_config); conversations through the bundled
tokenizer's chat template (completion-only: assistant_only_loss), prompt/completion data, plain
text, packed padding-free batches; loss_type "nll" and "dft"; sequence parallelism. Then the general rule for Trainer subclasses
(nxd_hf.parallel_trainer): an overridden hook gets parity or a clear error."""

import os
import random
import tempfile

import peft
import pytest
import torch
import transformers
import trl

from support import trl_args

from nxd_hf.integrations.subclass import parallel_trainer, refused_overrides
from nxd_hf.testing import run_distributed
from support.paths import EXAMPLES


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL's trainers send telemetry otherwise
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

TINY = str(EXAMPLES / "data" / "tiny-llama")
WORDS = open(os.path.join(os.path.dirname(TINY), "tiny_corpus.txt")).read().split()[:400]
TOL = dict(rtol=1e-4, atol=1e-5)
STEPS = trl_args.STEPS
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
    dp = 2 // (tp * pp * layout.get("context_parallel_size", 1))
    ref = trl.SFTTrainer(model(), trl.SFTConfig(output_dir=f"{out_dir}/ref", per_device_train_batch_size=batch * dp,
                                                **trl_args.common(**trl_args.global_eval_batch(sft, dp))),
                         train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer(),
                         peft_config=trl_args.lora_config() if lora else None)
    ref.train()
    args = nxd_hf.NxDSFTConfig(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=batch, **trl_args.common(**sft),
                               **layout)
    ours = nxd_hf.NxDSFTTrainer(model(), args, train_dataset=train, eval_dataset=evaluation,
                                processing_class=tokenizer(), peft_config=trl_args.lora_config() if lora else None)
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
    assert ours.state.total_flos == ref.state.total_flos > 0, (case, ours.state.total_flos, ref.state.total_flos)


def check_saved(ours, directory: str, *, kind: str, lora: bool, case, sft=None) -> None:
    """save_model's directory, opened in plain transformers / peft, evaluates (plain SFTTrainer)
    to the run's eval loss."""
    import trl

    from nxd_hf import backend, parallel_state

    want = ours.evaluate()
    ours.save_model(directory)
    if lora:
        plain = peft.PeftModel.from_pretrained(model(), directory)
        assert any("lora_B" in n for n, _ in plain.named_parameters())
    else:
        plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _, evaluation = datasets(kind)
    dp = parallel_state.get_data_parallel_replicas()
    args = trl.SFTConfig(output_dir=f"{directory}-eval", **trl_args.common(**trl_args.global_eval_batch(sft or {}, dp)))
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


CASES = [  # (name, data, per-replica batch, LoRA, SFTConfig overrides, layout)
    ("tp2-chat", "chat", 4, False, {}, {"tensor_parallel_size": 2}),
    ("pp2-text", "text", 4, False, {}, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
    ("dp2-zero1-chat-accumulate-checkpoint", "chat", 2, False,
     {"gradient_accumulation_steps": 2, "save_strategy": "steps", "save_steps": 4}, {"zero_1": True}),
    ("tp2-lora-chat-completion-only", "chat", 4, True, {"assistant_only_loss": True}, {"tensor_parallel_size": 2}),
    ("tp2-sp-dft-prompt-completion", "prompt", 4, False, {"loss_type": "dft", "pad_to_multiple_of": 2},
     {"tensor_parallel_size": 2, "sequence_parallel": True}),
    ("tp2-packed-padding-free-text", "text", 2, False, {"packing": True}, {"tensor_parallel_size": 2}),
]


def _sft_layouts() -> None:
    for name, kind, batch, lora, sft, layout in CASES:
        with tempfile.TemporaryDirectory() as out:
            out = shared_dir(out)
            ref, ours = run_pair(out, kind=kind, batch=batch, lora=lora, sft=sft, **layout)
            check_logs(ref, ours, name)
            if sft.get("save_strategy") == "steps":  # SFTTrainer's checkpoint: nxd_hf's, with TRL's model card
                assert "trainer_state.json" in os.listdir(f"{out}/nxd/checkpoint-4"), name
                assert "README.md" in os.listdir(f"{out}/ref") and "README.md" in os.listdir(f"{out}/nxd"), name
            check_saved(ours, f"{out}/final", kind=kind, lora=lora, case=name, sft=sft)


def test_sft_trainer_parity_at_every_layout():
    run_distributed(_sft_layouts, 2, timeout_s=900)


CP_CASES = [  # context parallelism: every CP rank gets the whole rows, the model splits the sequence
    ("cp2-chat", "chat", 4, False, {}, {"context_parallel_size": 2}),
    ("cp2-packed-padding-free-text", "text", 2, False, {"packing": True}, {"context_parallel_size": 2}),
]


def _sft_context_parallel(case) -> None:
    name, kind, batch, lora, sft, layout = case
    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        ref, ours = run_pair(out, kind=kind, batch=batch, lora=lora, sft=sft, **layout)
        check_logs(ref, ours, name)
        check_weights(ref, ours, name)


def check_weights(ref, ours, case) -> None:
    from nxd_hf.parallel_layers.sharding import full_tensor

    want = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), want[name].detach(), **TOL, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("case", CP_CASES, ids=[c[0] for c in CP_CASES])
def test_sft_trainer_cp2_matches_sft_trainer(ranks2, case):
    ranks2.run(_sft_context_parallel, case)


class ScaledLoss(transformers.Trainer):
    """A subclass whose loss is not the model's: nxd_hf must train on it, not on the model's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        return (2.0 * loss, outputs) if return_outputs else 2.0 * loss


class ExtraEval(transformers.Trainer):
    """evaluate() adding a metric computed from the model's own logits."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        ids = torch.stack([row["input_ids"] for row in self.eval_dataset])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits
        metrics[f"{metric_key_prefix}_logsumexp"] = float(logits.logsumexp(-1).mean())
        self.log({"eval_logsumexp": metrics[f"{metric_key_prefix}_logsumexp"]})
        return metrics


class OwnPrediction(transformers.Trainer):
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss * 3.0, logits, labels


class OwnLoop(transformers.Trainer):
    """evaluation_loop scaling the loss it reports: nxd_hf's evaluation must run it."""

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics[f"{metric_key_prefix}_loss"] *= 3.0
        return output


class OwnSave(transformers.Trainer):
    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)


def test_refused_overrides_name_the_hook():
    assert refused_overrides(ScaledLoss, pipelined=False) == []
    assert refused_overrides(ExtraEval, pipelined=False) == []
    assert refused_overrides(OwnPrediction, pipelined=False) == []
    assert refused_overrides(OwnLoop, pipelined=False) == []  # NxDTrainer's evaluation_loop runs it through super()
    assert "OwnLoop.evaluation_loop" in refused_overrides(OwnLoop, pipelined=True)[0]
    assert "ScaledLoss.compute_loss" in refused_overrides(ScaledLoss, pipelined=True)[0]
    assert "ExtraEval.evaluate" in refused_overrides(ExtraEval, pipelined=True)[0]
    assert "OwnPrediction.prediction_step" in refused_overrides(OwnPrediction, pipelined=True)[0]
    assert "OwnSave._save" in refused_overrides(OwnSave, pipelined=False)[0]
    assert refused_overrides(trl.SFTTrainer, pipelined=False) == []
    assert parallel_trainer(ScaledLoss).__name__ == "NxDScaledLoss"
    with pytest.raises(ValueError, match="Trainer subclass"):
        parallel_trainer(object)


@pytest.mark.parametrize("fields, message", [
    ({"tensor_parallel_size": 2, "sequence_parallel": True}, "pad_to_multiple_of"),
    ({"tensor_parallel_size": 2, "sequence_parallel": True, "pad_to_multiple_of": 3}, "pad_to_multiple_of"),
    ({"activation_offloading": True}, "activation_offloading"),
    ({"pipeline_parallel_size": 2, "packing": True}, "packing and padding_free"),
    ({"pipeline_parallel_size": 2, "padding_free": True}, "packing and padding_free"),
])
def test_sft_config_refuses_what_it_cannot_do(monkeypatch, tmp_path, fields, message):
    import nxd_hf

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=message):
        nxd_hf.NxDSFTConfig(output_dir=str(tmp_path), **fields)


def _composition_orders() -> None:
    """At tp=2: SFTTrainer before NxDTrainer (its hooks would replace the parallel ones: an eval loss
    0.3-0.6 too low, no SFT metrics) and NxDTrainer first by hand (the overrides unchecked) are refused
    as they are constructed; parallel_trainer's composition is the one that runs (parity: test above)."""
    import dataclasses

    import nxd_hf

    @dataclasses.dataclass(kw_only=True)
    class SFTNxDConfig(trl.SFTConfig, nxd_hf.NxDTrainingArguments):
        pass

    class SFTNxDTrainer(trl.SFTTrainer, nxd_hf.NxDTrainer):
        pass

    class NxDFirstByHand(nxd_hf.NxDTrainer, trl.SFTTrainer):
        pass

    args = SFTNxDConfig(output_dir="unused", tensor_parallel_size=2, **trl_args.common())
    data, held_out = datasets("text")
    for cls, why in ((SFTNxDTrainer, "SFTTrainer.* precede NxDTrainer in its method order, so .*compute_loss"),
                     (NxDFirstByHand, "composed by hand")):
        with pytest.raises(ValueError, match=f"{cls.__name__} combines NxDTrainer with .*SFTTrainer.*: {why}.* "
                                             "nxd_hf.NxDSFTTrainer .*nxd_hf.parallel_trainer"):
            cls(model(), args, train_dataset=data, eval_dataset=held_out, processing_class=tokenizer())
    assert nxd_hf.parallel_trainer(trl.SFTTrainer).nxd_checks_overrides


def _subclass_rule() -> None:
    import nxd_hf

    _composition_orders()
    for cls in (ScaledLoss, ExtraEval, OwnPrediction, OwnLoop):  # parity at tp=2
        ref, ours = run_trainer_pair(cls, tensor_parallel_size=2)
        for key in ("loss", "grad_norm", "eval_loss", "eval_logsumexp"):
            got, want = logged(ours, key), logged(ref, key)
            assert [s for s, _ in got] == [s for s, _ in want], (cls.__name__, key, got, want)
            torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]),
                                       **TOL, msg=lambda m: f"{cls.__name__} {key}: {m}")
    for cls, layout in ((ScaledLoss, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
                        (ExtraEval, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
                        (OwnPrediction, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
                        (OwnLoop, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
                        (OwnSave, {"tensor_parallel_size": 2})):
        with pytest.raises(ValueError, match=f"{cls.__name__}.* cannot run with nxd_hf"):
            run_trainer_pair(cls, reference=False, **layout)
    with pytest.raises(ValueError, match="NxDSFTConfig"):
        nxd_hf.NxDSFTTrainer(model(), nxd_hf.NxDTrainingArguments(output_dir="unused"),
                             train_dataset=datasets("text")[0])
    with pytest.raises(ValueError, match="padding-free"):  # one row: data parallelism cannot split it
        nxd_hf.NxDSFTTrainer(model(), nxd_hf.NxDSFTConfig(output_dir="unused", packing=True),
                             train_dataset=datasets("text")[0], processing_class=tokenizer())
    # the model parallelized first: SFTTrainer's peft_config would be lost (and the saved adapter miss keys)
    parallel = nxd_hf.parallelize(model(), tensor_parallel_size=2)
    args = nxd_hf.NxDSFTConfig(output_dir="unused", tensor_parallel_size=2, **trl_args.common())
    with pytest.raises(ValueError, match="already parallelized"):
        nxd_hf.NxDSFTTrainer(parallel, args, train_dataset=datasets("text")[0],
                             processing_class=tokenizer(), peft_config=trl_args.lora_config())


def test_trainer_subclass_overrides_get_parity_or_an_error():
    run_distributed(_subclass_rule, 2)


def _pipeline_saving() -> None:
    """pp=2: eval_loss at every eval step; the user's model object saves through nxd_hf (gathered,
    loadable in transformers) and, with LoRA adapters, writes peft's adapter files."""
    import nxd_hf
    from nxd_hf import backend, parallel_state

    with tempfile.TemporaryDirectory() as out:
        out = shared_dir(out)
        for lora in (False, True):
            parallel_state.destroy_model_parallel()
            rows = _token_rows()
            args = nxd_hf.NxDTrainingArguments(output_dir=out, pipeline_parallel_size=2, num_microbatches=2,
                                               max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="no",
                                               report_to=[], per_device_train_batch_size=4, disable_tqdm=True)
            user_model = model()
            trainer = nxd_hf.NxDTrainer(user_model, args, train_dataset=rows, eval_dataset=rows[:4],
                                        peft_config=trl_args.lora_config() if lora else None)
            trainer.train()
            assert [s for s, _ in logged(trainer, "eval_loss")] == [2, 4]
            if lora:  # the user's model object writes peft's adapter files, as peft's save_pretrained does
                user_model.save_pretrained(f"{out}/user-lora")
                backend.barrier()
                assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(f"{out}/user-lora"))
                backend.barrier()  # rank 0 leaves the loop and deletes its folder: every rank has looked
                continue
            user_model.save_pretrained(f"{out}/user")
            trainer.save_model(f"{out}/trainer")
            backend.barrier()
            ours = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/user").state_dict()
            want = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/trainer").state_dict()
            assert ours.keys() == want.keys()
            for name, tensor in ours.items():
                torch.testing.assert_close(tensor, want[name], rtol=0, atol=0)


def test_pp2_eval_every_step_and_model_save_pretrained():
    run_distributed(_pipeline_saving, 2)


def _token_stats_parity() -> None:
    """nxd_hf.integrations.token_stats on vocab shards (vocab 301, padded to 302 at tp=2) equals
    torch on the full logits: every field, the argmax's first-maximum rule, and the gradients of
    log_probs and entropy."""
    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.integrations.token_stats import token_stats

    parallel_state.destroy_model_parallel()
    nxd_hf.parallelize(model(), tensor_parallel_size=2)  # the TP groups
    vocab, rank = 301, parallel_state.get_tensor_model_parallel_rank()
    full = torch.randn(2, 5, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[0, 0] = -100
    full[1, 1, [3, 200]] = full[1, 1].max() + 1.0  # a tie: the label, 200, is not the first maximum
    labels[1, 1] = 200
    full[1, 2, 250] = full[1, 2].max() + 1.0  # the label on the second shard is the maximum
    labels[1, 2] = 250
    full.requires_grad_(True)
    local = torch.nn.functional.pad(full, (0, 1))[..., rank * 151:(rank + 1) * 151].detach().requires_grad_(True)
    got = token_stats(local, labels, vocab)
    mask = labels != -100
    log_p = full.log_softmax(-1)
    want = {"log_probs": log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1),
            "entropy": -(log_p.exp() * log_p).sum(-1), "log_sum_sq_probs": (2 * log_p).exp().sum(-1).log(),
            "mean_logits": full.mean(-1), "is_top1": full.argmax(-1) == labels}
    for key, value in want.items():
        expected = value.masked_fill(~mask, 0)
        torch.testing.assert_close(got[key].to(expected.dtype), expected.detach(), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    assert got["is_top1"][1, 2] and not got["is_top1"][1, 1]
    (got["log_probs"].sum() + got["entropy"].sum()).backward()
    (want["log_probs"].masked_fill(~mask, 0).sum() + want["entropy"].masked_fill(~mask, 0).sum()).backward()
    expected_grad = torch.nn.functional.pad(full.grad, (0, 1))[..., rank * 151:(rank + 1) * 151]
    torch.testing.assert_close(local.grad.double(), expected_grad, **TOL)


def test_token_stats_match_full_vocabulary():
    run_distributed(_token_stats_parity, 2)


def test_sft_example(rank_pools, tmp_path):
    """examples/sft_trl.py (capped) at tp=2 with LoRA, as torchrun starts it (on the pool's ranks:
    the launch is test_examples.py's): the loss falls; the adapter loads in peft."""
    import peft
    from support.scripts import loss_fell, run_on_ranks

    out = run_on_ranks(rank_pools, "examples/sft_trl.py", 2, "--tensor_parallel_size", "2", "--lora", "--max_steps",
                       "8", "--logging_steps", "4", "--eval_steps", "4", "--output_dir", str(tmp_path))
    loss_fell(out)
    plain = peft.PeftModel.from_pretrained(model(), tmp_path / "final")
    assert sum("lora_B" in name for name, _ in plain.named_parameters()) == 2 * 2  # q_proj, v_proj x 2 layers
