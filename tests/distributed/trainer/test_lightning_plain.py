"""A LightningModule written the usual way (not a NeuronLTModule) under NxDStrategy, against the
same module under plain Lightning in one process: the module as Lightning's text-transformers
tutorial writes one (GLUETransformer: the Hugging Face model built in ``__init__``, ``self(**batch)``,
``outputs[0]`` as the loss, AdamW over two parameter groups, transformers' linear warmup schedule
over ``trainer.estimated_stepping_batches`` stepped every step, a torchmetrics metric), with
``gradient_clip_val``, at tp=2 and dp=2, with ``accumulate_grad_batches`` at dp=2, a head of the
module's own outside the Hugging Face model, LoRA, ``from_pretrained`` or ZeRO-3 set up in
``configure_model``, and ``precision="bf16-mixed"``; the refusals; the example under the unified
``lightning`` package. Before, NxDStrategy left such a module alone: at dp=2 each replica trained
its own copy (nothing averaged the gradients). Checkpoints: test_lightning_plain_checkpoints.py."""

import contextlib
import functools
import io
import os

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.lightning import NxDStrategy
from support import hf_parity
from test_lightning import LOSS_TOL, TOL, _shared, _trainer

GLOBAL_BATCH, SEQ, N_TRAIN, EPOCHS = 4, 10, 16, 2
CLIP = 0.05  # below the gradients' norm at every step: clipping by this rank's shards' norm would show


def _rows(n: int, seed: int) -> list[dict]:
    """Rows of 4 to 10 tokens, padded to SEQ (attention_mask 0), each with one of 3 labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(5, hf_parity.VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < 4 + i % 7).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor(i % 3)})
    return rows


def _loaders(dp: int, n_train: int = N_TRAIN):
    """Lightning deals shuffled data out by DP rank (DistributedSampler, seed 0): the
    one-process reference (dp=0) reads the same batches."""
    data = _rows(n_train, 1)
    order = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if dp == 0 else None
    per_replica = GLOBAL_BATCH // max(dp, 1)
    return (torch.utils.data.DataLoader(data, batch_size=per_replica, sampler=order),
            torch.utils.data.DataLoader(_rows(8, 2), batch_size=per_replica))


def _bert():
    return hf_parity.build_pair("bert", task_model_cls=transformers.BertForSequenceClassification, num_labels=3)[1]


class SequenceClassifier(pl.LightningModule):
    """Lightning's tutorial idiom for a transformers model."""

    def __init__(self, model, learning_rate: float = 2e-3, warmup_steps: int = 2, weight_decay: float = 0.01):
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.val_rows = torchmetrics.SumMetric()  # synced by torchmetrics itself: the rows of every replica once

    def forward(self, **inputs):
        return self.model(**inputs)

    def training_step(self, batch, batch_idx):
        loss = self(**batch)[0]
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        val_loss, logits = self(**batch)[:2]
        self.log("val_loss", val_loss, sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), sync_dist=True)
        self.val_rows.update(len(batch["labels"]))
        self.log("val_rows", self.val_rows, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        no_decay = ["bias", "LayerNorm.weight"]
        named = list(self.model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
             "weight_decay": self.hparams.weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, eps=1e-4)  # eps: see test_lightning
        scheduler = transformers.get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=self.hparams.warmup_steps,
            num_training_steps=self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}]


class PooledHead(SequenceClassifier):
    """A base model (AutoModel) and a classifier of the module's own, outside it."""

    def __init__(self, model):
        super().__init__(model.bert)
        self.classifier = nn.Linear(model.config.hidden_size, 3)
        with torch.no_grad():
            self.classifier.weight.copy_(model.classifier.weight)
            self.classifier.bias.copy_(model.classifier.bias)

    def forward(self, labels=None, **inputs):
        logits = self.classifier(self.model(**inputs).pooler_output)
        return nn.functional.cross_entropy(logits, labels), logits

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-3, eps=1e-4)
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=8), "interval": "step"}]


class Adapted(SequenceClassifier):
    """LoRA added in configure_model: by peft (the reference), or by nxd_hf.parallelize with
    lora_config, which the strategy then keeps as it is."""

    def __init__(self, model, tp: int | None = None):
        super().__init__(model)
        self.tp = tp

    def configure_model(self):
        import peft

        config = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
        if self.tp is None:
            self.model = peft.get_peft_model(self.model, config)
        elif nxd_hf.model_state.state_of(self.model) is None:
            self.model = nxd_hf.parallelize(self.model, tensor_parallel_size=self.tp, lora_config=config)


class Loaded(SequenceClassifier):
    """The model read in configure_model, as Lightning suggests for large ones: by transformers'
    from_pretrained (the reference), or by nxd_hf.from_pretrained, each rank reading its own slices."""

    def __init__(self, model, tp: int | None = None, *, directory: str):
        super().__init__(None)
        self.tp, self.directory = tp, directory
        if backend.rank() == 0:
            model.save_pretrained(self.directory)
        backend.barrier()

    def configure_model(self):
        if self.model is not None:
            return
        if self.tp is None:
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(self.directory)
        else:
            self.model = nxd_hf.from_pretrained(self.directory, tensor_parallel_size=self.tp,
                                                auto_class=transformers.AutoModelForSequenceClassification)
        self.model.train()  # from_pretrained returns eval mode


class Sharded(SequenceClassifier):
    """Parallelized in configure_model with parallelize's options: ZeRO-3 (FSDP2 over the data-parallel
    ranks: parameters, gradients and AdamW's state sharded) with activation checkpointing."""

    def __init__(self, model, tp: int | None = None):
        super().__init__(model)
        self.tp = tp

    def configure_model(self):
        if self.tp is not None and nxd_hf.model_state.state_of(self.model) is None:
            nxd_hf.parallelize(self.model, tensor_parallel_size=self.tp, data_parallel_sharding="zero3",
                               activation_checkpoint_config="full")


MODULES = {"Sharded": Sharded, "SequenceClassifier": SequenceClassifier, "PooledHead": PooledHead, "Adapted": Adapted, "Loaded": Loaded}


class Losses(pl.Callback):
    def __init__(self):
        self.train, self.vals = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["loss"]))

    def on_validation_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        self.vals.append((float(metrics["val_loss"]), float(metrics["val_acc"]), float(metrics["val_rows"])))


def _fit(out: str, module, strategy, dp: int, epochs: int = EPOCHS, ckpt_path=None, n_train: int = N_TRAIN,
         callbacks=(), **kwargs):
    trainer, _ = _trainer(out, strategy, epochs, gradient_clip_val=CLIP, **kwargs)
    losses = Losses()
    trainer.callbacks.extend([losses, *callbacks])
    train, val = _loaders(dp, n_train)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return trainer, losses


def _reference(out: str, module_cls=SequenceClassifier, **kwargs):
    module = module_cls(_bert())
    module.val_rows = torchmetrics.SumMetric(sync_on_compute=False)  # a process of its own, not the test's world
    _, losses = _fit(os.path.join(out, f"ref{backend.rank()}"), module, None, 0, **kwargs)
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _check(losses, ref_losses, module, ref_state, steps: int) -> None:
    assert len(losses.train) == len(ref_losses.train) == steps, (losses.train, ref_losses.train)
    torch.testing.assert_close(torch.tensor(losses.train), torch.tensor(ref_losses.train), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(losses.vals), torch.tensor(ref_losses.vals), **LOSS_TOL)
    full = {f"model.{k}": v for k, v in nxd_hf.full_state_dict(module.model).items()}
    full.update({k: v for k, v in module.state_dict().items() if not k.startswith("model.")})
    for name, value in ref_state.items():
        ours = name.replace("base_model.model.", "")  # a peft model's names: as save_pretrained writes them
        ours = ours if ours in full else ours.replace(".base_layer", "")
        torch.testing.assert_close(full[ours].cpu(), value, **TOL, msg=name)


def check_plain_module(out: str, tp: int, module_cls_name: str, accumulate: int) -> None:
    out = _shared(out)
    module_cls = MODULES[module_cls_name]
    if module_cls is Loaded:
        module_cls = functools.partial(Loaded, directory=os.path.join(out, "saved"))
    parallel_state.destroy_model_parallel()
    ref_losses, ref_state = _reference(out, module_cls, accumulate_grad_batches=accumulate)
    module = module_cls(_bert(), **({"tp": tp} if module_cls_name in ("Adapted", "Loaded", "Sharded") else {}))
    trainer, losses = _fit(os.path.join(out, "nxd"), module, NxDStrategy(tensor_parallel_size=tp), 2 // tp,
                           accumulate_grad_batches=accumulate)
    assert parallel_state.get_tensor_model_parallel_size() == tp
    assert nxd_hf.model_state.state_of(module.model) is not None  # parallelized by the strategy
    if module_cls_name == "Sharded":  # FSDP2's data-parallel shards
        assert all(isinstance(p, DTensor) for p in module.model.parameters())
    _check(losses, ref_losses, module, ref_state, EPOCHS * N_TRAIN // GLOBAL_BATCH)


def check_bf16_mixed(out: str) -> None:
    """Lightning's precision="bf16-mixed" (its own plugin, autocast) at tp=2, clipping by the whole
    norm under it: bf16 matmuls, so the losses agree to bf16's precision."""
    out = _shared(out)
    parallel_state.destroy_model_parallel()
    ref_losses, _ = _reference(out, precision="bf16-mixed")
    fp32_losses, _ = _reference(os.path.join(out, "fp32"))
    _, losses = _fit(os.path.join(out, "nxd"), SequenceClassifier(_bert()), NxDStrategy(tensor_parallel_size=2), 1,
                     precision="bf16-mixed")
    torch.testing.assert_close(torch.tensor(losses.train), torch.tensor(ref_losses.train), rtol=1e-2, atol=1e-2)
    assert losses.train != fp32_losses.train  # autocast was on


def check_refusals(out: str) -> None:
    out = _shared(out)
    parallel_state.destroy_model_parallel()
    train, _ = _loaders(1)

    def fit(module, strategy):
        trainer = pl.Trainer(strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, default_root_dir=out)
        trainer.fit(module, train)
        return trainer

    with pytest.raises(ValueError, match="cannot call. Use NeuronLTModule"):
        fit(SequenceClassifier(_bert()), NxDStrategy(pipeline_parallel_size=2))
    parallel_state.destroy_model_parallel()

    class NoHFModel(SequenceClassifier):
        def __init__(self):
            super().__init__(None)
            self.layer = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="holds no Hugging Face model to shard"):
        fit(NoHFModel(), NxDStrategy(tensor_parallel_size=2))
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="nxd_config describes the model and optimizer that NeuronLTModule builds"):
        fit(SequenceClassifier(_bert()), NxDStrategy(config))
    parallel_state.destroy_model_parallel()
    import peft

    adapted = peft.get_peft_model(_bert(), peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"]))
    with pytest.raises(ValueError, match="a peft model over an unparallelized model"):
        fit(SequenceClassifier(adapted), NxDStrategy(tensor_parallel_size=2))
    parallel_state.destroy_model_parallel()
    module = SequenceClassifier(_bert())
    fit(module, NxDStrategy(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="parallelized at tensor_parallel_size=2, pipeline_parallel_size=1, this "
                                         "NxDStrategy at 1, 1"):
        fit(module, NxDStrategy(tensor_parallel_size=1))  # the same module again, at other sizes
    parallel_state.destroy_model_parallel()

    class FreeTensor(SequenceClassifier):
        def configure_optimizers(self):
            self.free = torch.zeros(3, requires_grad=True)  # not registered: nothing would save it
            return torch.optim.AdamW([*self.parameters(), self.free])

    trainer = fit(FreeTensor(_bert()), NxDStrategy(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="trains tensors that are not the module's parameters"):
        trainer.save_checkpoint(os.path.join(out, "free.ckpt"))


@pytest.mark.parametrize("tp, module_cls, accumulate", [
    (2, "SequenceClassifier", 1), (1, "SequenceClassifier", 1), (1, "SequenceClassifier", 2), (2, "PooledHead", 1),
    (1, "PooledHead", 2), (2, "Adapted", 1), (2, "Loaded", 1), (1, "Sharded", 1), (1, "Sharded", 2)],
    ids=["tp2", "dp2", "dp2-accumulate", "tp2-own-head", "dp2-own-head-accumulate", "tp2-lora-in-configure_model",
         "tp2-from_pretrained-in-configure_model", "dp2-zero3-in-configure_model",
         "dp2-zero3-accumulate"])
def test_plain_lightning_module(ranks2, tmp_path, tp, module_cls, accumulate):
    ranks2.run(check_plain_module, str(tmp_path), tp, module_cls, accumulate)


def test_plain_lightning_module_bf16_mixed(ranks2, tmp_path):
    ranks2.run(check_bf16_mixed, str(tmp_path))


def test_plain_lightning_module_refusals(ranks2, tmp_path):
    ranks2.run(check_refusals, str(tmp_path))


def test_own_module_example(rank_pools, tmp_path):
    """examples/lightning_own_module.py at tp=2 (as torchrun starts it, on fresh ranks of the pool),
    written with the unified package (``import lightning as L``, which nxd_hf.lightning then builds
    on): the loss falls, rank 0 reports once, and its checkpoint is an nxd_hf checkpoint with
    Lightning's state."""
    from support.scripts import loss_fell, run_on_ranks

    rank_pools.close()  # ranks that imported nxd_hf.lightning on pytorch_lightning (this file's tests) go

    out = run_on_ranks(rank_pools, "examples/lightning_own_module.py", 2, "--tp", "2", "--max-steps", "12",
                       "--output-dir", str(tmp_path))
    assert out.count("loss fell from") == 1 and "tp 2 x dp 1" in out, out[-3000:]
    first, last = loss_fell(out)
    assert last < first - 0.5, out[-3000:]
    assert (tmp_path / "last.ckpt" / "lightning_state.pt").exists() and (tmp_path / "checkpoints.json").exists()
