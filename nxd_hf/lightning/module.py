"""``NeuronLTModule``: a LightningModule whose model and optimizer are nxd_hf's. Training steps
go through ``model.run_train`` (the pipeline schedule under PP; forward and backward otherwise),
so optimization is manual, as in NxD."""

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.lightning.flavor import pl
from nxd_hf.trainer import initialize_parallel_model, initialize_parallel_optimizer


class NeuronLTModule(pl.LightningModule):
    """The document's arguments. Batches are dicts of the model's inputs with ``labels``
    (a tokenizer's batch); ``training_step``/``validation_step`` log ``loss``/``val_loss``
    (the step's mean over data parallelism, the same value on every rank). ``log_rank0``:
    the progress bar and ``NeuronTensorBoardLogger`` write from global rank 0 instead of the last
    pipeline stage (no extra communication here: the loss is on every rank)."""

    def __init__(self, model_fn, nxd_config, opt_cls, scheduler_cls=None, model_args=(), model_kwargs=None,
                 opt_args=(), opt_kwargs=None, scheduler_args=(), scheduler_kwargs=None, grad_accum_steps: int = 1,
                 log_rank0: bool = False, manual_opt: bool = True):
        super().__init__()
        if not manual_opt:
            raise ValueError("NeuronLTModule(manual_opt=False): automatic optimization is not supported (nor in "
                             "NxD): keep manual_opt=True; training_step runs the optimizer")
        if opt_args:
            raise ValueError("NeuronLTModule: pass the optimizer's options by name in opt_kwargs (opt_args is "
                             "not supported: initialize_parallel_optimizer takes keywords)")
        if grad_accum_steps < 1:
            raise ValueError(f"NeuronLTModule: grad_accum_steps must be >= 1, got {grad_accum_steps}")
        self.automatic_optimization = False
        self.model_fn, self.nxd_config, self.opt_cls, self.scheduler_cls = model_fn, nxd_config, opt_cls, scheduler_cls
        self.model_args, self.model_kwargs = tuple(model_args), dict(model_kwargs or {})
        self.opt_kwargs = dict(opt_kwargs or {})
        self.scheduler_args, self.scheduler_kwargs = tuple(scheduler_args), dict(scheduler_kwargs or {})
        self.grad_accum_steps, self.log_rank0 = grad_accum_steps, log_rank0
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:  # Lightning calls it again on each fit/validate
            self.model = initialize_parallel_model(self.nxd_config, self.model_fn, *self.model_args, **self.model_kwargs)
            self.model.train()  # from_pretrained returns eval mode, which Lightning (2.2+) would keep
            if self.grad_accum_steps > 1 and not self.model.hf_loss:
                # run_train runs backward on each batch's own mean: the step would sum, not average, them
                raise ValueError(f"NeuronLTModule(grad_accum_steps={self.grad_accum_steps}) with "
                                 f"{type(self.model.hf_model).__name__}, which computes its own loss: its "
                                 "micro-batches' gradients would add up instead of averaging; use grad_accum_steps=1 "
                                 "with a larger batch")

    def configure_optimizers(self):
        optimizer = initialize_parallel_optimizer(self.nxd_config, self.opt_cls, self.model.parameters(), **self.opt_kwargs)
        if self.scheduler_cls is None:
            return optimizer
        scheduler = self.scheduler_cls(optimizer, *self.scheduler_args, **self.scheduler_kwargs)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def training_step(self, batch, batch_idx):
        # HF's loss is normalized by the step's label tokens; a model that computes its own loss
        # (one built from parallel layers, a plain module) takes only its forward's inputs
        count = {"num_items_in_batch": self._step_tokens(batch)} if self.model.hf_loss else {}
        loss = self.model.run_train(**batch, **count)
        first = batch_idx % self.grad_accum_steps == 0
        self._accumulated, self._micro_batches = (loss, 1) if first else (self._accumulated + loss, self._micro_batches + 1)
        # the epoch's trailing batches make a step of their own, as Lightning's accumulate_grad_batches
        last = batch_idx + 1 == self.trainer.num_training_batches
        if (batch_idx + 1) % self.grad_accum_steps == 0 or last:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
            scheduler = self.lr_schedulers()
            if scheduler is not None:
                scheduler.step()
            # the mean of the step's micro-batch losses (each share is weighted for grad_accum_steps of them)
            step_loss = self._accumulated * (self.grad_accum_steps / self._micro_batches)
            self.log("loss", step_loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model.run_eval(**batch).detach().float()
        # sync_dist: NxDStrategy.reduce averages over data parallelism
        self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _step_tokens(self, batch) -> torch.Tensor:
        """The optimizer step's count of label tokens over DP ranks, counting each of its
        ``grad_accum_steps`` micro-batches as this one (run_train weights tokens over the step)."""
        count = (batch["labels"][..., 1:] != -100).sum().to(torch.float32)
        backend.all_reduce(count, parallel_state.get_data_parallel_group())
        return count * self.grad_accum_steps
