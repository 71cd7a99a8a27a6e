"""nxd_hf.lightning (NeuronLTModule, NxDStrategy, the progress bar and TensorBoard logger) against
plain PyTorch Lightning in one process on the same tiny Llama, data and seed: logged losses every
step, validation loss, final parameters, the logger's event file and the progress bar (one rank
writes), at tp=2, pp=2 and dp=2 with ZeRO-1; a checkpoint saved at tp=2 resumed at tp=1 x dp=2."""

import contextlib
import glob
import io
import os

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import store
from nxd_hf.lightning import (
    logging_rank, NeuronLTModule, NeuronTensorBoardLogger, NeuronTQDMProgressBar, NeuronXLAPrecisionPlugin,
    NxDStrategy,
)
from support import hf_parity
from support.paths import REPO


GLOBAL_BATCH, SEQ, LR = 4, 8, 1e-2
EPOCHS, STEPS_PER_EPOCH = 2, 4  # 8 optimizer steps, a validation after each epoch
N_TRAIN = GLOBAL_BATCH * STEPS_PER_EPOCH
# Adam's update g / (sqrt(v) + eps) divides by the gradient's own size: with torch's eps=1e-8 an
# element whose gradient is rounding noise (a few 1e-10: terms that cancel) steps by a sizable
# fraction of lr, with a sign that depends on the CPU's summation order (the BLAS kernels of the
# machine; tp/pp/dp sum in other orders too). eps=1e-4 bounds d(update)/dg by lr/eps = 100, so
# rounding-level gradient differences stay ~1e-8 in the parameters on any CPU (emulated with
# float64 gradients: 4e-7 at most over 8 steps here, against 1.1e-5 with eps=1e-8), while the
# gradients of this model (~1e-3 after clipping) still take Adam-sized steps. It also makes the
# update depend on the gradient's scale, so a clipping difference shows in the parameters.
OPT = dict(lr=LR, eps=1e-4)
TOL = dict(rtol=1e-4, atol=1e-5)  # parameters
LOSS_TOL = dict(rtol=1e-5, atol=0.0)  # logged losses: summation order moves them by ~2e-7 relative


def tiny_llama():
    config_cls, model_cls, kwargs = hf_parity.TINY["llama"]
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs))


def samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_parity.VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]


def loaders(dp: int, n_train: int = N_TRAIN):
    """Lightning shuffles training data when distributed (DistributedSampler, seed 0, by epoch) and
    deals it out by DP rank: the single-process reference (dp=0) reads the same order."""
    per_replica = GLOBAL_BATCH // max(dp, 1)
    data = samples(n_train, 1)
    order = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if dp == 0 else None
    train = torch.utils.data.DataLoader(data, batch_size=per_replica, sampler=order)
    val = torch.utils.data.DataLoader(samples(8, 2), batch_size=per_replica)
    return train, val


def scheduler(optimizer):
    """Stepped every optimizer step, over the whole run (the first step at lr / 3)."""
    return torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=EPOCHS * STEPS_PER_EPOCH)


class PlainModule(pl.LightningModule):
    """The reference: plain Lightning, automatic optimization, the same model and schedule."""

    def __init__(self):
        super().__init__()
        self.model = tiny_llama()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), **OPT)
        return [optimizer], [{"scheduler": scheduler(optimizer), "interval": "step"}]


class Losses(pl.Callback):
    """Every training step's logged loss, and each validation's loss."""

    def __init__(self, every: int = 1):
        self.train, self.vals, self.every = [], [], every

    @property
    def val(self):
        return self.vals[-1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.every == 0 or batch_idx + 1 == trainer.num_training_batches:  # ours log at steps
            self.train.append(float(trainer.callback_metrics["loss"]))

    def on_validation_end(self, trainer, pl_module):
        self.vals.append(float(trainer.callback_metrics["val_loss"]))


def _trainer(out: str, strategy=None, epochs: int = 1, logger=None, bar=None, every: int = 1, **kwargs):
    callbacks = [Losses(every)] + ([bar] if bar else [])
    trainer = pl.Trainer(strategy=strategy or "auto", accelerator="cpu", devices=1, max_epochs=epochs,
                         default_root_dir=out, logger=logger or False, enable_checkpointing=False,
                         enable_progress_bar=bar is not None, enable_model_summary=False, num_sanity_val_steps=0,
                         log_every_n_steps=1, deterministic=True, callbacks=callbacks, **kwargs)
    return trainer, callbacks[0]


def reference(out: str, epochs: int = EPOCHS, n_train: int = N_TRAIN, **kwargs):
    """Plain Lightning in this process (each rank computes the same thing)."""
    module = PlainModule()
    trainer, losses = _trainer(os.path.join(out, f"ref{backend.rank()}"), gradient_clip_val=1.0,
                               logger=pl.loggers.TensorBoardLogger(os.path.join(out, f"ref_tb{backend.rank()}")),
                               epochs=epochs, **kwargs)
    train, val = loaders(0, n_train)
    saved = rank_zero_only.rank, fabric_rank_zero_only.rank
    rank_zero_only.rank = fabric_rank_zero_only.rank = 0  # one process of its own: its logger writes
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(module, train, val)
    finally:
        rank_zero_only.rank, fabric_rank_zero_only.rank = saved
    return losses, module.model.state_dict(), _scalars(trainer.logger.log_dir)


def _scalars(log_dir: str) -> list[tuple[int, float]]:
    files = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer
    events = EventAccumulator(files[0])
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")]


def nxd_module(tp: int = 1, pp: int = 1, zero1: bool = False, **kwargs) -> NeuronLTModule:
    config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pipeline_config={"num_microbatches": 2} if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": 1.0})
    return NeuronLTModule(tiny_llama, config, torch.optim.AdamW, scheduler, opt_kwargs=OPT, **kwargs)


def ours(out: str, module: NeuronLTModule, epochs: int = EPOCHS, ckpt_path=None, tb: bool = False,
         n_train: int = N_TRAIN, **kwargs):
    dp = parallel_state.get_data_parallel_size()
    bar = NeuronTQDMProgressBar(refresh_rate=1) if tb else None
    logger = NeuronTensorBoardLogger(os.path.join(out, "tb"), name="run", version=0) if tb else None
    trainer, losses = _trainer(os.path.join(out, "nxd"), NxDStrategy(module.nxd_config), epochs, logger, bar,
                               every=module.grad_accum_steps, **kwargs)
    train, val = loaders(dp, n_train)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return trainer, losses, printed.getvalue()


def _check_run(losses, ref_losses, model, ref_state) -> None:
    """Every step's logged loss and every validation's loss at LOSS_TOL, then the parameters."""
    assert len(losses.train) == len(ref_losses.train) == EPOCHS * STEPS_PER_EPOCH, (losses.train, ref_losses.train)
    assert len(losses.vals) == len(ref_losses.vals) == EPOCHS
    torch.testing.assert_close(torch.tensor(losses.train), torch.tensor(ref_losses.train), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(losses.vals), torch.tensor(ref_losses.vals), **LOSS_TOL)
    full = nxd_hf.full_state_dict(model)
    for name, value in ref_state.items():
        torch.testing.assert_close(full[name].cpu(), value, **TOL, msg=name)


def check_parity(out: str, tp: int, pp: int, zero1: bool, log_rank0: bool = False) -> None:
    """8 steps (AdamW, LinearLR every step, clipping at 1.0) and 2 validations: logged losses,
    validation losses, the logger's events and final parameters."""
    out = _shared(out)
    ref_losses, ref_state, ref_events = reference(out)
    trainer, losses, printed = ours(out, nxd_module(tp, pp, zero1, log_rank0=log_rank0), tb=True)
    assert (tp, pp, parallel_state.get_data_parallel_size()) == (tp, pp, 2 // (tp * pp))
    _check_run(losses, ref_losses, trainer.lightning_module.model, ref_state)
    backend.barrier()
    here = backend.rank() == logging_rank(log_rank0)
    assert logging_rank(log_rank0) == (1 if pp == 2 and not log_rank0 else 0)  # the last stage, or rank 0
    files = glob.glob(os.path.join(out, "tb", "run", "version_0", "events.out.tfevents.*"))
    assert len(files) == 1, files  # one rank wrote
    if here:  # the same scalars at the same steps as plain Lightning's logger, once per step
        events = _scalars(os.path.join(out, "tb", "run", "version_0"))
        assert [s for s, _ in events] == [s for s, _ in ref_events]
        torch.testing.assert_close(torch.tensor([v for _, v in events]), torch.tensor([v for _, v in ref_events]),
                                   **LOSS_TOL)
        assert f"{STEPS_PER_EPOCH}/{STEPS_PER_EPOCH}" in printed, printed  # the bar reached the epoch's last step
    else:
        assert printed == "", printed  # no bar on the other ranks


def check_resume_resharded(out: str) -> None:
    """The first epoch at tp=2, a Lightning checkpoint, the second at tp=1 x dp=2 (ZeRO-1): plain
    Lightning's two epochs (losses, both validations, parameters; the schedule continues)."""
    out = _shared(out)
    ref_losses, ref_state, _ = reference(out)
    trainer, first, _ = ours(out, nxd_module(tp=2), epochs=1)
    path = os.path.join(out, "ckpt", "epoch1.ckpt")
    trainer.save_checkpoint(path)
    trainer, second, _ = ours(out, nxd_module(tp=1, zero1=True), ckpt_path=path)
    first.train, first.vals = first.train + second.train, first.vals + second.vals
    _check_run(first, ref_losses, trainer.lightning_module.model, ref_state)


def check_accumulation(out: str, tp: int) -> None:
    """grad_accum_steps=2 against plain Lightning's accumulate_grad_batches=2 over 3 batches: a
    step of two, then the epoch's trailing batch as a step of its own; the loss logged at a step is
    the mean of plain Lightning's batches' losses."""
    out = _shared(out)
    ref_losses, ref_state, _ = reference(out, epochs=1, n_train=12, accumulate_grad_batches=2)
    trainer, losses, _ = ours(out, nxd_module(tp=tp, zero1=tp == 1, grad_accum_steps=2), epochs=1, n_train=12)
    ref = ref_losses.train  # plain Lightning logs every batch (every=1)
    torch.testing.assert_close(torch.tensor(losses.train), torch.tensor([(ref[0] + ref[1]) / 2, ref[2]]), **LOSS_TOL)
    torch.testing.assert_close(float(losses.val), float(ref_losses.val), **LOSS_TOL)
    full = nxd_hf.full_state_dict(trainer.lightning_module.model)
    for name, value in ref_state.items():
        torch.testing.assert_close(full[name].cpu(), value, **TOL, msg=name)


def check_bf16_autocast(out: str) -> None:
    """NeuronXLAPrecisionPlugin at tp=2 against plain Lightning's precision="bf16-mixed" (CPU
    autocast): bf16 matmuls, so losses agree to bf16's precision, not fp32's."""
    out = _shared(out)
    ref_losses, _, _ = reference(out, epochs=1, precision="bf16-mixed")
    fp32_losses, _, _ = reference(os.path.join(out, "fp32"), epochs=1)
    trainer, losses, _ = ours(out, nxd_module(tp=2), epochs=1, plugins=[NeuronXLAPrecisionPlugin()])
    torch.testing.assert_close(torch.tensor(losses.train), torch.tensor(ref_losses.train), rtol=1e-2, atol=1e-2)
    assert losses.train != fp32_losses.train  # autocast was on


def _shared(out: str) -> str:
    """Rank 0's directory on every rank."""
    return backend.all_gather_object(out)[0]


def check_callbacks_and_reduce(out: str) -> None:
    """ModelCheckpoint (top-1: nxd_hf checkpoint directories, the older one removed) and
    EarlyStopping (reduce_boolean_decision) run under the strategy at tp=2; reduce takes Lightning's
    strings and torch's ReduceOp over data parallelism."""
    out = _shared(out)
    module = nxd_module(tp=2)
    # the newest is the best: the first epoch's checkpoint is removed
    best = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), monitor="step", mode="max", save_top_k=1)
    stop = pl.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    trainer = pl.Trainer(strategy=NxDStrategy(module.nxd_config), max_epochs=2, logger=False,
                         callbacks=[best, stop], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out, num_sanity_val_steps=0)
    train, val = loaders(1, n_train=8)
    trainer.fit(module, train, val)
    backend.barrier()
    kept = os.path.basename(best.best_model_path)
    assert kept == "epoch=1-step=4.ckpt", kept
    assert sorted(os.listdir(os.path.join(out, "ckpts"))) == sorted(["checkpoints.json", "owner.json", kept]), best.best_model_path
    assert store.read_tracker(os.path.join(out, "ckpts"))["complete"] == [kept]
    assert os.path.exists(os.path.join(best.best_model_path, "lightning_state.pt"))
    strategy = trainer.strategy
    value = torch.tensor(float(backend.rank() + 1))
    assert float(strategy.reduce(value, reduce_op="sum")) == float(value)  # dp=1: its own
    assert float(strategy.reduce(value, reduce_op=torch.distributed.ReduceOp.SUM)) == float(value)
    assert float(strategy.reduce(value, group=torch.distributed.group.WORLD, reduce_op="mean")) == 1.5
    assert strategy.reduce_boolean_decision(backend.rank() == 0, all=False)
    assert not strategy.reduce_boolean_decision(backend.rank() == 0, all=True)
    mismatched = pl.Trainer(strategy=NxDStrategy(tensor_parallel_size=1), max_epochs=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    try:
        mismatched.fit(nxd_module(tp=2), train, val)
    except ValueError as error:  # on every rank, before anything is built
        assert "does not match the module's nxd_config" in str(error), error
    else:
        raise AssertionError("a strategy layout other than the module's config trained")


@pytest.mark.parametrize("tp, pp, zero1, log_rank0", [(2, 1, False, False), (1, 2, False, False), (1, 2, False, True),
                                                    (1, 1, True, False)],
                         ids=["tp2", "pp2", "pp2-log_rank0", "dp2-zero1"])
def test_lightning_parity(ranks2, tmp_path, tp, pp, zero1, log_rank0):
    ranks2.run(check_parity, str(tmp_path), tp, pp, zero1, log_rank0)


def test_lightning_bf16_autocast(ranks2, tmp_path):
    ranks2.run(check_bf16_autocast, str(tmp_path))


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2-zero1", "tp2"])
def test_lightning_gradient_accumulation(ranks2, tmp_path, tp):
    ranks2.run(check_accumulation, str(tmp_path), tp)


def test_lightning_checkpoint_resumes_resharded(ranks2, tmp_path):
    ranks2.run(check_resume_resharded, str(tmp_path))


def test_lightning_example_under_torchrun(rank_pools, tmp_path):
    """examples/lightning_causal_lm.py (capped): 12 steps at tp=2 under torchrun, then resumed from
    its checkpoint at dp=2 with ZeRO-1 for 8 more (--max-steps counts this run's steps; as torchrun
    starts it, on the pool's ranks); the loss falls, one rank prints and logs, and the resumed run
    says where it starts."""
    import subprocess
    import sys

    from support.scripts import run_on_ranks

    root = str(REPO)
    rank_pools.close()  # torchrun's processes only

    def run(*args):
        script_args = ["--output-dir", str(tmp_path), *args]
        if "--resume" in args:
            stdout = run_on_ranks(rank_pools, "examples/lightning_causal_lm.py", 2, *script_args)
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                       "examples/lightning_causal_lm.py", *script_args]
            result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            stdout = result.stdout
        lines = [line for line in stdout.splitlines() if "loss fell from" in line]
        assert len(lines) == 1, stdout[-3000:]  # one rank reports
        first, last = map(float, lines[0].split("loss fell from ")[1].split(" to "))
        return first, last, stdout

    first, last, _ = run("--tp", "2", "--max-steps", "12")
    assert last < first - 0.5
    checkpoint = str(tmp_path / "last.ckpt")
    resumed_first, resumed_last, printed = run("--zero1", "--max-steps", "8", "--resume", checkpoint)
    assert resumed_first < first - 0.5 and resumed_last <= resumed_first + 0.1  # went on from the checkpoint
    said = [line for line in printed.splitlines() if line.startswith("resuming from")]
    assert said == [f"resuming from {checkpoint} (step 12, epoch 1): training to step 20"], printed[-3000:]
    runs = {}  # version directory -> the processes that wrote event files there (fit, then validate)
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        runs.setdefault(events.parent.name, set()).add(events.name.split(".")[-2])
    assert sorted(runs) == ["version_0", "version_1"] and all(len(pids) == 1 for pids in runs.values()), runs


def test_lightning_callbacks_and_reduce(ranks2, tmp_path):
    ranks2.run(check_callbacks_and_reduce, str(tmp_path))
