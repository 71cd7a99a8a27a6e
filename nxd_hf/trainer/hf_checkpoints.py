"""``NxDTrainer``'s saving and resuming, as ``Trainer``'s hooks (every rank takes part).

- ``save_model(dir)``: a plain Hugging Face model directory (``nxd_hf.save_pretrained``:
  gathered, unpadded, the names ``save_pretrained`` writes) or, with LoRA, a PEFT adapter
  directory (``nxd_hf.lora.save_adapter``); the tokenizer/processor and training arguments too.
- ``checkpoint-N/`` every ``save_steps``: ``nxd_hf.save_checkpoint`` (model, optimizer,
  scheduler, every rank's RNG states, in logical coordinates: it resumes at other parallel
  sizes; with LoRA, what the ``LoraConfig`` says: the adapter alone by default, see
  ``nxd_hf.lora.checkpoint``) with ``trainer_state.json``, the training arguments and the tokenizer written inside
  before the completion marker; the temporary directory is ``.checkpoint-N.tmp``, which
  ``get_last_checkpoint`` never matches. ``save_total_limit`` keeps the newest complete ones (and
  the best one, as ``Trainer``).
- ``load_best_model_at_end``: ``best_metric`` / ``best_model_checkpoint`` tracked as ``Trainer``
  tracks them; the best checkpoint's model (or adapter) is loaded at the end.
- ``train(resume_from_checkpoint=True | path)``: the checkpoint's model, optimizer and scheduler
  once the optimizer exists; RNG states where ``Trainer`` restores them (after skipping the
  trained batches: the data position follows from ``global_step``, as in ``Trainer``).
"""

import os

import torch
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from nxd_hf import backend
from nxd_hf.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
from nxd_hf.checkpoint import store
from nxd_hf.checkpoint.load import restore_rng_states, verify_checkpoint
from nxd_hf.checkpoint.store import INDEX


class CheckpointHooks:
    """The ``Trainer`` hooks above; mixed into ``NxDTrainer``."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        if self.nxd_config.lora_config is not None or hasattr(self.nxd_model.hf_model, "peft_config"):
            from nxd_hf.lora import save_adapter

            save_adapter(self.nxd_model.module, output_dir)
        else:
            save_pretrained(self.nxd_model, output_dir)
        if backend.rank() == 0:
            self._write_side_files(output_dir)
        backend.barrier()

    def _write_side_files(self, directory: str) -> None:
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def _save_checkpoint(self, model, trial) -> None:
        self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        tag = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

        def side_files(directory: str) -> None:
            self._write_side_files(directory)
            self._record_callback_states()
            self.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))

        self._track_best_checkpoint(run_dir, tag)
        save_checkpoint(run_dir, tag=tag, model=self.nxd_model, optimizer=self._nxd_optimizer(),
                        scheduler=self.lr_scheduler, side_files=side_files,
                        user_content={"global_step": self.state.global_step})
        if self.args.save_total_limit is not None and self.args.save_total_limit > 0:
            if backend.rank() == 0:  # as Trainer's rotation: the best checkpoint is kept too
                best = self.state.best_model_checkpoint
                store.prune(run_dir, self.args.save_total_limit, keep=(os.path.basename(best),) if best else ())
            backend.barrier()

    def _track_best_checkpoint(self, run_dir: str, tag: str) -> None:
        """``state.best_model_checkpoint`` as ``Trainer._save_checkpoint`` sets it (before the
        trainer state is written into the checkpoint); the one being saved counts as existing."""
        if self.state.best_global_step:
            best_tag = f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}"
            if best_tag == tag or os.path.isdir(os.path.join(run_dir, best_tag)):
                self.state.best_model_checkpoint = os.path.join(run_dir, best_tag)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the model (or adapters) of the best checkpoint, at any sizes."""
        run_dir, tag = os.path.split(os.path.normpath(self.state.best_model_checkpoint))
        load_checkpoint(run_dir, tag=tag, model=self.nxd_model)

    def _record_callback_states(self) -> None:
        """What ``Trainer._save_checkpoint`` records of its stateful callbacks."""
        from transformers.trainer_callback import ExportableState

        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()

    def _nxd_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper

    # -- resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not os.path.isfile(os.path.join(resume_from_checkpoint, INDEX)):
            raise ValueError(f"{resume_from_checkpoint} is not an nxd_hf checkpoint (no {INDEX}): NxDTrainer resumes "
                             "from the checkpoint-N directories it saved")
        # before Trainer reads trainer_state.json: every file against its checksum, on every rank
        verify_checkpoint(*os.path.split(os.path.normpath(resume_from_checkpoint)))
        if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):  # older checkpoints
            raise ValueError(f"{resume_from_checkpoint} has no {TRAINER_STATE_NAME}: it was not saved by NxDTrainer "
                             "or the file was lost. Resume from another checkpoint-N, or load only the weights with "
                             "nxd_hf.load_checkpoint(run_dir, tag=..., model=...)")
        # the weights load with the optimizer and scheduler, once they exist

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        run_dir, tag = os.path.split(os.path.normpath(checkpoint))
        saved = load_checkpoint(run_dir, tag=tag, model=self.nxd_model, optimizer=self._nxd_optimizer(),
                                scheduler=self.lr_scheduler)
        _check_resumed_step(checkpoint, saved, self.state.global_step)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            run_dir, tag = os.path.split(os.path.normpath(checkpoint))
            restore_rng_states(run_dir, tag)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # inside the checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # inside the checkpoint, per rank


def _check_resumed_step(checkpoint: str, saved, global_step: int) -> None:
    """The step Trainer resumes at (from trainer_state.json) must be the step the checkpoint was
    saved at: otherwise training would silently restart or skip steps."""
    step = saved.get("global_step") if isinstance(saved, dict) else None
    if step is not None and step != global_step:
        raise ValueError(
            f"resuming from {checkpoint}: it was saved at step {step} but the trainer state resumes at step "
            f"{global_step} ({TRAINER_STATE_NAME} was changed or is from another run). Resume from a checkpoint-N "
            "directory NxDTrainer saved, unchanged, or from an older one")
