"""Checkpoints of a LightningModule of one's own under NxDStrategy (test_lightning_plain.py's
modules), against plain Lightning in one process: the first epoch at tp=2 (or at dp=2 under
ZeRO-3), ``trainer.save_checkpoint``, the second epoch at another layout from it, also with a head
of the module's own whose AdamW moments the resumed run needs, each checkpoint consolidated and
opened in plain transformers; a weights-only checkpoint (no
optimizer state anywhere) validated at another layout, and refused by Lightning for ``fit``."""

import contextlib
import io
import json
import os

import pytest
import pytorch_lightning as pl
import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.lightning import NxDStrategy
from test_lightning import LOSS_TOL, _shared, _trainer
from test_lightning_plain import (
    EPOCHS, GLOBAL_BATCH, MODULES, N_TRAIN, PooledHead, Sharded, _bert, _check, _fit, _loaders, _reference,
)


class StopAfterFirstEpoch(pl.Callback):
    """A run of EPOCHS stopped after its first (the schedule spans all of them)."""

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def check_resume_resharded(out: str, module_cls_name: str, zero3_first: bool) -> None:
    """The first epoch at tp=2 (or at dp=2 under ZeRO-3, parallelized in configure_model),
    trainer.save_checkpoint, the second at dp=2 (or tp=2): plain Lightning's two epochs (the warmup
    schedule continues from the checkpoint; a head of the module's own, and its AdamW moments, come
    from the checkpoint too)."""
    out = _shared(out)
    module_cls = MODULES[module_cls_name]
    parallel_state.destroy_model_parallel()
    ref_losses, ref_state = _reference(out, module_cls)
    first_module = Sharded(_bert(), tp=1) if zero3_first else module_cls(_bert())
    first_tp, second_tp = (1, 2) if zero3_first else (2, 1)
    trainer, first = _fit(os.path.join(out, "first"), first_module, NxDStrategy(tensor_parallel_size=first_tp),
                          2 // first_tp, callbacks=[StopAfterFirstEpoch()])
    path = os.path.join(out, "ckpt", "epoch1.ckpt")
    trainer.save_checkpoint(path)
    _check_opens_in_transformers(path, first_module.model, os.path.join(out, "hf"))
    parallel_state.destroy_model_parallel()
    module = module_cls(_bert())
    with torch.no_grad():  # the checkpoint, not these weights, must be what trains on
        for p in module.parameters():
            p.add_(1.0)
    trainer, second = _fit(os.path.join(out, "second"), module, NxDStrategy(tensor_parallel_size=second_tp),
                           2 // second_tp, ckpt_path=path)
    first.train, first.vals = first.train + second.train, first.vals + second.vals
    _check(first, ref_losses, module, ref_state, EPOCHS * N_TRAIN // GLOBAL_BATCH)


def _check_opens_in_transformers(path: str, model, hf_dir: str) -> None:
    """The checkpoint's model, consolidated, is a plain transformers model with the weights trained."""
    trained = nxd_hf.full_state_dict(model)
    if backend.rank() == 0:
        nxd_hf.consolidate(path, hf_dir)
        loaded = getattr(transformers, type(model).__name__.removeprefix("FSDP")).from_pretrained(hf_dir)
        state = loaded.state_dict()
        for name, value in trained.items():
            torch.testing.assert_close(state[name], value.cpu(), rtol=0, atol=0, msg=name)
    backend.barrier()


def check_weights_only(out: str) -> None:
    """save_checkpoint(weights_only=True) (ModelCheckpoint's save_weights_only): no optimizer state
    in nxd_hf's files or for the module's own head; validate from it at another layout gives the
    saving run's validation; fit from it is refused by Lightning, as from its own weights-only files."""
    out = _shared(out)
    parallel_state.destroy_model_parallel()
    trainer, losses = _fit(os.path.join(out, "tp2"), PooledHead(_bert()), NxDStrategy(tensor_parallel_size=2), 1,
                           epochs=1)
    path = os.path.join(out, "ckpt", "weights.ckpt")
    trainer.save_checkpoint(path, weights_only=True)
    index = json.load(open(os.path.join(path, "index.json")))
    assert not index["tensors"].get("optimizer") and "model" in index["tensors"], sorted(index["tensors"])
    state = torch.load(os.path.join(path, "lightning_state.pt"), weights_only=False)
    assert state["nxd_hf_outside_model"]["optimizer"] == {} and "classifier.weight" in state["nxd_hf_outside_model"]["tensors"]
    parallel_state.destroy_model_parallel()
    module = PooledHead(_bert())
    validator, _ = _trainer(os.path.join(out, "dp2"), NxDStrategy(tensor_parallel_size=1))
    _, val = _loaders(2)
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = validator.validate(module, val, ckpt_path=path, verbose=False)[0]
    torch.testing.assert_close(metrics["val_loss"], losses.vals[-1][0], **LOSS_TOL)
    with pytest.raises(KeyError, match="contains only the model"):
        _fit(os.path.join(out, "resume"), PooledHead(_bert()), NxDStrategy(tensor_parallel_size=1), 2, ckpt_path=path)


@pytest.mark.parametrize("module_cls, zero3_first", [("SequenceClassifier", False), ("PooledHead", False),
                                                     ("SequenceClassifier", True)],
                         ids=["tp2-to-dp2", "own-head-tp2-to-dp2", "dp2-zero3-to-tp2"])
def test_plain_lightning_module_resumes_resharded(ranks2, tmp_path, module_cls, zero3_first):
    ranks2.run(check_resume_resharded, str(tmp_path), module_cls, zero3_first)


def test_plain_lightning_module_weights_only_checkpoint(ranks2, tmp_path):
    ranks2.run(check_weights_only, str(tmp_path))
