"""``NxDTrainer``: ``transformers.Trainer`` with tensor, pipeline and data parallelism.

It overrides the fewest hooks it can; everything else (callbacks, schedulers, logging,
``compute_metrics``, ``HfArgumentParser``) is ``Trainer``'s own:

- the model is parallelized once through the config API (``initialize_parallel_model``), and
  ``_wrap_model`` hands that ``NxDModel`` to the loop, so accelerate never wraps it in DDP;
- data: every rank draws the same global batch (``per_device_train_batch_size x dp``) from
  ``Trainer``'s own loader, so a step holds the samples ``Trainer`` would use on one process
  with that batch size, and keeps its data-parallel slice (TP and PP ranks of one replica get
  the same slice);
- loss: token-weighted over microbatches, accumulation steps and DP ranks, as ``Trainer``
  computes it on one process (``num_items_in_batch``); the logged loss is the DP mean;
- optimizer: ``initialize_parallel_optimizer`` (ZeRO-1 with ``zero_1``) does the DP reduction
  and the clipping on the global norm; the logged ``grad_norm`` is that norm;
- ``total_flos``: of the unparallelized model and the global batch (``nxd_hf.trainer.flops``);
- saving and resuming: ``nxd_hf.trainer.hf_checkpoints``;
- evaluation: every rank evaluates the whole evaluation set, in global batches
  (``per_device_eval_batch_size`` rows per replica, as in training: ``batches.global_eval_batch``);
  ``compute_metrics`` and ``predict`` see the full logits (gathered over TP, unpadded; under PP
  sent from the last stage).
"""

import contextlib
import inspect
import warnings

import torch
import transformers

from nxd_hf import backend, parallel_state
from nxd_hf.model_setup.liger import apply_liger_kernels
from nxd_hf.model_state import state_of
from nxd_hf.optim.zero1 import ELEMENTWISE_OPTIMIZERS
from nxd_hf.parallel_layers.loss_functions import loss_normalizer
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.pipeline.pooled_loss import rows_over_data_parallel, takes_pooled_logits
from nxd_hf.trainer.arguments import NxDTrainingArguments, one_process_view
from nxd_hf.trainer.composition import check_composition
from nxd_hf.trainer.flops import global_flos, logical_non_embedding_parameters
from nxd_hf.trainer.batches import (
    FILLER_ROWS, ROW_WEIGHT, check_dataset_size, data_parallel_mean, global_eval_batch, pad_rows, pipeline_inputs,
    replica_rows, warn_single_packed_rows,
)
from nxd_hf.trainer.given_model import check_layout, is_parallel, place_model, resolve_auto_sizes
from nxd_hf.trainer.hf_checkpoints import CheckpointHooks
from nxd_hf.trainer.mean_loss import label_weight
from nxd_hf.trainer.model import NxDModel, loss_of, initialize_parallel_model
from nxd_hf.trainer.optimizer import initialize_parallel_optimizer
from nxd_hf.trainer.own_model import check_trainer_model
from nxd_hf.trainer.user_hooks import check_user_overrides, runs_own_compute_loss
from nxd_hf.trainer.options import (
    check_liger, compile_model, setup_label_smoothing, smoothed_loss, without_trainers_liger_patch,
)


class NxDTrainer(CheckpointHooks, transformers.Trainer):
    """A drop-in for ``transformers.Trainer`` taking ``NxDTrainingArguments`` (module docstring).
    ``model``: a plain HF model (parallelized here, with LoRA adapters when ``peft_config``, a
    ``peft.LoraConfig``, is given), an already parallelized one, a peft model of one, or the user's
    own module built from nxd_hf's parallel layers (``nxd_hf.trainer.own_model``; docs/trainer.md).
    ``autocast_adapter_dtype``: as ``peft.get_peft_model``'s (fp32 adapters on a bf16/fp16 model)."""

    def __new__(cls, *args, **kwargs):
        check_composition(cls, NxDTrainer)  # before any class's __init__ (another trainer's may run first)
        return super().__new__(cls)

    def __init__(self, model=None, args: NxDTrainingArguments | None = None, *trainer_args, model_init=None,
                 peft_config=None, autocast_adapter_dtype: bool = True, **trainer_kwargs):
        if not isinstance(args, NxDTrainingArguments):
            raise ValueError("NxDTrainer takes args=nxd_hf.NxDTrainingArguments(...) (a TrainingArguments subclass "
                             "carrying tensor_parallel_size, pipeline_parallel_size, ...)")
        check_user_overrides(type(self), NxDTrainer, pipelined=args.pipeline_parallel_size > 1)
        if args.use_liger_kernel:
            check_liger(args)
        if backend.rank() != 0:  # torch's DataLoader gives it on every rank alike (while iterating): rank 0's is enough
            warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        if trainer_kwargs.get("compute_loss_func") is not None:
            raise ValueError("compute_loss_func is not supported by NxDTrainer: the model's own loss runs on "
                             "vocab-parallel logits")
        if args.has_auto_sizes:
            resolve_auto_sizes(args, model, peft_config)
        if model is not None and is_parallel(model):  # before nxd_config() re-creates the groups
            check_layout(args, pipelined=isinstance(getattr(model, "module", model), NxDPPModel))
        self.nxd_config = args.nxd_config(lora_config=peft_config)
        self.nxd_config.autocast_adapter_dtype = autocast_adapter_dtype
        self.nxd_model: NxDModel | None = None
        if model is not None:
            model = self._parallel(model, args)
        if model_init is not None:  # passed only when given: a Trainer subclass may not take it (TRL's)
            trainer_kwargs["model_init"] = self._parallel_init(model_init, args)
        one_process_view(args.distributed_state)  # Trainer's Accelerator is built from it
        with without_trainers_liger_patch(args):
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if args.use_liger_kernel:
            apply_liger_kernels(self.model, args.liger_kernel_config)
        if self.nxd_model is not None:
            setup_label_smoothing(self)

    def _parallel_init(self, model_init, args: NxDTrainingArguments):
        """``model_init`` (taking a trial or nothing, as Trainer allows) whose model is parallelized."""
        takes_trial = len(inspect.signature(model_init).parameters) == 1

        def parallel_model_init(trial=None):
            return self._parallel(model_init(trial) if takes_trial else model_init(), args)

        return parallel_model_init

    def _parallel(self, model, args: NxDTrainingArguments):
        """Parallelize ``model`` as ``args`` say (or check an already parallel one); returns the HF
        model ``Trainer`` inspects (the original one under PP) and keeps the ``NxDModel``."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model
        if isinstance(model, NxDModel):
            self.nxd_model = model
        elif isinstance(model, NxDPPModel) or state_of(base) is not None:
            if self.nxd_config.lora_config is not None:  # the adapters would be missing, and missing when saved
                raise ValueError("peft_config with an already parallelized model: pass the plain HF model with "
                                 "peft_config=... (nxd_hf adds the adapters as it parallelizes), or apply "
                                 "peft.get_peft_model to the parallel model and pass peft_config=None")
            self.nxd_model = NxDModel(model, self.nxd_config)
        elif base is not model:
            raise ValueError("a peft model of an unparallelized model: pass the plain model with peft_config=..., "
                             "or apply peft.get_peft_model after nxd_hf.parallelize")
        else:
            check_trainer_model(model, args.tensor_parallel_size, args.pipeline_parallel_size)
            if args.bf16_master_weights:
                model = model.to(torch.bfloat16)
            self.nxd_model = initialize_parallel_model(self.nxd_config, lambda: model)
        place_model(self.nxd_model, args.device)  # every layout, as Trainer places its model
        if args.torch_compile:
            compile_model(self.nxd_model, args)
        return self.nxd_model.hf_model

    # -- the process view
    def is_world_process_zero(self) -> bool:
        return backend.rank() == 0

    def is_local_process_zero(self) -> bool:
        return self.is_world_process_zero()

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.nxd_model

    # -- data: loaders accelerate never shards by process (arguments.one_process_view)
    def _one_process(self) -> None:
        """Accelerate's two shared states (the loaders, the token count and the gathers read them)
        one process again, should a ``TrainingArguments`` or ``Trainer`` built since have re-inferred them."""
        one_process_view(self.args.distributed_state)
        one_process_view(self.accelerator.state)

    def get_train_dataloader(self):
        check_dataset_size(self.train_dataset, "train_dataset")
        self._one_process()
        per_replica = self._train_batch_size
        self._train_batch_size = per_replica * parallel_state.get_data_parallel_replicas()
        try:
            return super().get_train_dataloader()
        finally:
            self._train_batch_size = per_replica

    def get_eval_dataloader(self, eval_dataset=None):
        self._one_process()
        with global_eval_batch(self):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        self._one_process()
        with global_eval_batch(self):
            return super().get_test_dataloader(test_dataset)

    def evaluation_loop(self, *args, **kwargs):
        with global_eval_batch(self):  # it weighs each batch's loss by eval_batch_size
            return super().evaluation_loop(*args, **kwargs)

    def get_total_train_batch_size(self, args) -> int:
        return args.train_batch_size * args.gradient_accumulation_steps * parallel_state.get_data_parallel_replicas()

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """Global batches and their token count, then this replica's rows of each. The input tokens
        seen (``include_num_input_tokens_seen``) are counted here, on the global batches: ``Trainer``
        counts the batch it trains on, which is one replica's rows here."""
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        for batch in batches:
            super()._track_num_input_tokens(batch)
            warn_single_packed_rows(self, batch)
        return [self._nxd_replica_rows(batch) for batch in batches], num_items_in_batch

    def _track_num_input_tokens(self, inputs):
        pass  # counted on the global batches in get_batch_samples

    def floating_point_ops(self, inputs: dict) -> int:
        """Of the unparallelized model and this replica's rows (``flops``); ``store_flos`` sums the replicas."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters") or inputs.get(FILLER_ROWS):
            return 0
        counted = getattr(self, "_nxd_counted_parameters", None)
        if counted is None or counted[0] is not self.nxd_model:  # model_init builds a new model per trial
            counted = self._nxd_counted_parameters = (self.nxd_model,
                                                      logical_non_embedding_parameters(self.nxd_model))
        return 6 * inputs[main_input].numel() * counted[1]

    def store_flos(self) -> None:
        self.state.total_flos += global_flos(self.current_flos)
        self.current_flos = 0

    def _nxd_replica_rows(self, batch: dict) -> dict:  # the preference trainers keep chosen/rejected pairs together
        return replica_rows(batch)

    # -- the step
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
            if optimizer_cls not in ELEMENTWISE_OPTIMIZERS:
                raise ValueError(
                    f"optim={self.args.optim!r} ({getattr(optimizer_cls, '__name__', optimizer_cls)}) is not "
                    "element-wise: on tensor-parallel shards it would compute per-shard statistics. Use an "
                    "element-wise optimizer such as optim='adamw_torch' or 'sgd'")
            self.optimizer = initialize_parallel_optimizer(self.nxd_config, optimizer_cls, self._param_groups(),
                                                           **kwargs)
        return self.optimizer

    def _param_groups(self) -> list[dict]:
        decay = set(self.get_decay_parameter_names(self.nxd_model))
        named = [(n, p) for n, p in self.nxd_model.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]

    def compute_loss_context_manager(self):
        if self.args.bf16:  # as Trainer's accelerate autocast: bf16 compute over the weights' dtype
            return torch.autocast(backend.default_device().type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def training_step(self, model, inputs, num_items_in_batch=None):
        # the data-parallel reduction (overlapped with backward) only on an accumulation's last micro-step
        with contextlib.nullcontext() if self.accelerator.sync_gradients else model.no_sync():
            return self._training_step(model, inputs, num_items_in_batch)

    def _training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        row_weight, filler_rows = inputs.pop(ROW_WEIGHT), inputs.pop(FILLER_ROWS)
        with self.compute_loss_context_manager():
            if model.pipelined:  # the schedule runs backward and returns the DP-averaged share
                # a short batch is padded to whole microbatches with rows whose labels are ignored
                padded, padded_rows = pad_rows(pipeline_inputs(model, inputs), model.module.num_microbatches,
                                               filler_rows=filler_rows)
                if num_items_in_batch is None and takes_pooled_logits(model.module.hf_model):
                    # a per-batch mean over rows, which Trainer divides by the accumulation steps
                    rows = rows_over_data_parallel(padded["labels"])
                    num_items_in_batch = rows * self.current_gradient_accumulation_steps
                with smoothed_loss(self):
                    return model.run_train(**padded, num_items_in_batch=num_items_in_batch, padded_rows=padded_rows)
            # a model's own mean over its labels (mean_loss) weighs by this replica's share of them
            own_mean = model.own_mean_loss and "labels" in inputs  # not a subclass's loss of other inputs
            weight = label_weight(inputs["labels"], filler=bool(filler_rows)) if own_mean else None
            if num_items_in_batch is not None and self.model_accepts_loss_kwargs:  # as Trainer: no 1/accumulation
                loss = self._nxd_loss(model, inputs, num_items_in_batch=loss_normalizer(inputs["labels"],
                                                                                        num_items_in_batch))
                loss = loss if weight is None else loss * weight
            else:  # a per-batch mean: weight this replica's rows, average over accumulation steps
                weight = row_weight if weight is None else weight
                loss = self._nxd_loss(model, inputs) * weight / self.current_gradient_accumulation_steps
            if filler_rows:  # a replica without rows: zero gradients, but its collectives still run
                loss = loss * 0.0
        loss.backward()
        return data_parallel_mean(loss.detach())

    def _nxd_loss(self, model, inputs: dict, **loss_kwargs) -> torch.Tensor:
        """This rank's training loss (not pipelined); ``nxd_hf.parallel_trainer`` routes a subclass's
        ``compute_loss`` through here. A model nxd_hf did not shard from a Hugging Face plan (the
        user's own, ``nxd_hf.trainer.own_model``) may return the loss itself or a dict holding it. A
        subclass's own ``compute_loss`` computes it, as in ``Trainer``'s step (``user_hooks``)."""
        if runs_own_compute_loss(self):
            return self.compute_loss(model, inputs, **loss_kwargs)
        with smoothed_loss(self):
            output = model(**inputs, **loss_kwargs)
        return output.loss if model.hf_loss else loss_of(output, type(model.hf_model).__name__, "NxDTrainer")

    def _clip_grad_norm(self, model):
        return None  # the optimizer clips on the global norm in step()

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper
        norm = getattr(optimizer, "grad_norm", None)
        return super()._maybe_log_save_evaluate(tr_loss, norm if norm is not None else grad_norm, model,
                                                *args, **kwargs)

    # -- evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not model.pipelined:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = pipeline_inputs(model, self._prepare_inputs(inputs))
        rows = inputs["labels"].shape[0]
        padded, padded_rows = pad_rows(inputs, model.module.num_microbatches)
        with torch.no_grad(), self.compute_loss_context_manager():
            with smoothed_loss(self):
                result = model.run_eval(**padded, return_logits=not prediction_loss_only, padded_rows=padded_rows)
        if prediction_loss_only:
            return result.detach(), None, None
        loss, logits = result
        return loss.detach(), logits[:rows], inputs["labels"]
