"""``parallel_trainer(cls)`` and ``parallel_arguments(cls)``: nxd_hf's behaviour for any
``transformers.Trainer`` subclass and its arguments class.

Why a generic mechanism rather than one class per trainer: TRL's trainers (SFT, DPO, reward,
...) and users' own subclasses all override the same few ``Trainer`` hooks. One rule covers
them: ``NxDTrainer`` goes first in the method order (parallel model, data split, optimizer,
saving), and every hook the subclass overrides either runs on nxd_hf's parallel path or is
refused with a ``ValueError`` when the trainer is built (on every rank) — never a different
number:

- ``compute_loss``: runs in training (``NxDTrainer._nxd_loss``) and evaluation on the parallel
  model, whose ``loss`` is the vocab-parallel loss and whose ``logits`` are gathered over TP
  outside training; metrics gathered with ``accelerator.gather_for_metrics`` inside a
  training step are gathered over the data-parallel replicas. TRL's fused LM head, which
  reads ``lm_head.weight`` (a vocabulary shard under TP), is replaced by
  ``nxd_hf.integrations.fused_head``. Under pipeline parallelism nothing but the schedule can
  run the model: refused unless the trainer class lists it in ``nxd_pipeline_hooks`` (it then
  provides the pipeline version, as ``NxDSFTTrainer`` does).
- ``prediction_step``, ``evaluate``, ``evaluation_loop``, ``predict``: as ``compute_loss``.
- hooks that ``NxDTrainer`` replaces (saving, the optimizer, the data split, the training step):
  a subclass's override would never run, so it is refused unless listed in ``KEPT`` with the
  reason its behaviour is kept.
"""

import torch
import transformers

from nxd_hf import backend, parallel_state
from nxd_hf.integrations import fused_head
from nxd_hf.trainer.arguments import NxDTrainingArguments
from nxd_hf.trainer.user_hooks import runs_own_compute_loss
from nxd_hf.trainer.hf_trainer import NxDTrainer

MODEL_RUNNING = ("compute_loss", "prediction_step", "evaluate", "evaluation_loop", "predict")
REPLACED = tuple(sorted({name for cls in NxDTrainer.__mro__[:2] for name, value in vars(cls).items()
                         if callable(value) and not name.startswith("__")} | {"_save"}))
# hooks NxDTrainer defines that run the subclass's own through super() (prediction_step: outside
# pipeline parallelism, where the MODEL_RUNNING rule applies)
PASSED_ON = ("prediction_step", "evaluation_loop")
# overrides that NxDTrainer's replacement keeps the behaviour of: "module.Class.method" -> why
KEPT = {
    "trl.trainer.sft_trainer.SFTTrainer.training_step": "enters activation offloading only (refused by "
                                                        "NxDSFTConfig) before Trainer's step",
    "trl.trainer.sft_trainer.SFTTrainer._save_checkpoint": "writes a model card (NxDSFTTrainer does too)",
    "trl.trainer.dpo_trainer.DPOTrainer.training_step": "enters activation offloading only (refused by "
                                                        "NxDDPOConfig) before Trainer's step",
    "trl.trainer.dpo_trainer.DPOTrainer._save_checkpoint": "writes a model card (NxDDPOTrainer does too)",
    "trl.trainer.reward_trainer.RewardTrainer.training_step": "enters activation offloading only (refused by "
                                                              "NxDRewardConfig) before Trainer's step",
    "trl.trainer.reward_trainer.RewardTrainer._save_checkpoint": "writes a model card (NxDRewardTrainer does too)",
}
# trainers whose nxd_hf version needs more than the generic composition: "module.Class" -> "module:Class"
SPECIALIZED = {"trl.trainer.dpo_trainer.DPOTrainer": "nxd_hf.integrations.dpo:NxDDPOTrainer",
               "trl.trainer.reward_trainer.RewardTrainer": "nxd_hf.integrations.reward:NxDRewardTrainer"}
SPECIALIZED_ARGUMENTS = {"trl.trainer.dpo_config.DPOConfig": "nxd_hf.integrations.dpo:NxDDPOConfig",
                         "trl.trainer.reward_config.RewardConfig": "nxd_hf.integrations.reward:NxDRewardConfig"}


def _overrides(trainer_cls: type) -> dict[str, str]:
    """Hooks that ``trainer_cls`` (or a base below ``transformers.Trainer``) defines: name ->
    "module.Class.name" of the first definition in the method order."""
    found = {}
    for klass in trainer_cls.__mro__:
        if klass.__module__.startswith("nxd_hf.") or issubclass(NxDTrainer, klass):
            continue  # nxd_hf's own classes, and Trainer and its bases
        for name in {*MODEL_RUNNING, *REPLACED} & set(vars(klass)):
            found.setdefault(name, f"{klass.__module__}.{klass.__qualname__}.{name}")
    return found


def refused_overrides(trainer_cls: type, *, pipelined: bool) -> list[str]:
    """The overrides of ``trainer_cls`` that nxd_hf cannot honour at this layout, with why."""
    handled = set(getattr(trainer_cls, "nxd_pipeline_hooks", ()))
    refused = []
    for name, where in sorted(_overrides(trainer_cls).items()):
        if where in KEPT or (name in handled and pipelined):
            continue
        if name in REPLACED and name not in PASSED_ON:
            refused.append(f"{where} (nxd_hf replaces {name}: the override would never run)")
        elif name in MODEL_RUNNING and pipelined and name not in handled:
            refused.append(f"{where} (under pipeline parallelism only the schedule runs the model)")
    return refused


class ParallelTrainerMixin(NxDTrainer):
    """``NxDTrainer`` placed before a ``Trainer`` subclass (see the module docstring)."""

    nxd_pipeline_hooks: tuple[str, ...] = ()
    nxd_checks_overrides = True  # nxd_hf.trainer.composition: this composition checks every override

    def __init__(self, model=None, args=None, *trainer_args, **trainer_kwargs):
        if isinstance(args, NxDTrainingArguments):
            refused = refused_overrides(type(self), pipelined=args.pipeline_parallel_size > 1)
            if refused:
                raise ValueError(f"{type(self).__name__} cannot run with nxd_hf at tp={args.tensor_parallel_size}, "
                                 f"pp={args.pipeline_parallel_size}: " + "; ".join(refused) +
                                 ". Move the logic to a TrainerCallback or to the model's forward, or drop "
                                 "pipeline parallelism for overrides that run the model")
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        if not self.nxd_model.pipelined:
            hf_model = self.nxd_model.hf_model
            fused_head.install(hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model)
        self._nxd_in_training_step = False
        self.accelerator.gather_for_metrics = self._nxd_gather(self.accelerator.gather_for_metrics)
        self.accelerator.gather = self._nxd_gather(self.accelerator.gather)

    def _nxd_loss(self, model, inputs: dict, **loss_kwargs):
        # NxDTrainer._nxd_loss runs the subclass's compute_loss; its metrics gather over DP meanwhile
        self._nxd_in_training_step = runs_own_compute_loss(self)
        try:
            return super()._nxd_loss(model, inputs, **loss_kwargs)
        finally:
            self._nxd_in_training_step = False

    def _nxd_gather(self, original):
        """Inside a training step each replica holds its rows of the batch: gather over the
        data-parallel group (the TP/PP ranks of a replica hold the same values). Elsewhere every
        rank holds the whole batch: nothing to gather."""

        def gather(value, *args, **kwargs):
            return dp_gather(value) if self._nxd_in_training_step else original(value, *args, **kwargs)

        return gather


def dp_gather(value):
    """``accelerator.gather`` over the data-parallel group: tensors concatenated along dim 0
    (scalars become one row per replica)."""
    if isinstance(value, (list, tuple)):
        return type(value)(dp_gather(v) for v in value)
    if isinstance(value, dict):
        return {k: dp_gather(v) for k, v in value.items()}
    rows = value.detach().reshape(1) if value.dim() == 0 else value.detach()
    with torch.no_grad():  # as accelerate's gather: values for metrics, no gradient
        gathered = backend.all_gather(rows.contiguous(), 0, parallel_state.get_data_parallel_group())
    cp_size = parallel_state.get_context_parallel_size()
    if cp_size == 1:
        return gathered
    # the data-parallel group is dp x cp in blocks of cp consecutive ranks, and the CP ranks of a
    # replica hold the same (whole-sequence) values: one block per replica
    return gathered.view(-1, cp_size, *rows.shape)[:, 0].reshape(-1, *rows.shape[1:])


def parallel_trainer(trainer_cls: type) -> type:
    """``NxD<Name>``: ``trainer_cls`` (a ``transformers.Trainer`` subclass) with ``NxDTrainer``'s
    behaviour (module docstring). Its ``args`` must be ``NxDTrainingArguments`` or, when the
    subclass wants its own arguments class, ``parallel_arguments(that class)``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise ValueError(f"parallel_trainer takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, NxDTrainer):
        return trainer_cls
    if _qualified(trainer_cls) in SPECIALIZED:
        return _specialized(SPECIALIZED[_qualified(trainer_cls)])
    return type(f"NxD{trainer_cls.__name__}", (ParallelTrainerMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} on nxd_hf (nxd_hf.parallel_trainer)."})


def parallel_arguments(arguments_cls: type) -> type:
    """``NxD<Name>``: a dataclass with the fields of ``NxDTrainingArguments`` and of
    ``arguments_cls`` (a ``TrainingArguments`` subclass, e.g. TRL's ``SFTConfig``), usable in one
    ``HfArgumentParser``; an instance is both."""
    if not (isinstance(arguments_cls, type) and issubclass(arguments_cls, transformers.TrainingArguments)):
        raise ValueError(f"parallel_arguments takes a transformers.TrainingArguments subclass, got {arguments_cls!r}")
    if issubclass(arguments_cls, NxDTrainingArguments):
        return arguments_cls
    if _qualified(arguments_cls) in SPECIALIZED_ARGUMENTS:
        return _specialized(SPECIALIZED_ARGUMENTS[_qualified(arguments_cls)])
    return combined_arguments(arguments_cls)


def combined_arguments(arguments_cls: type) -> type:
    """``parallel_arguments``' generic dataclass (without looking for a specialized one)."""
    import dataclasses

    combined = type(f"NxD{arguments_cls.__name__}", (NxDTrainingArguments, arguments_cls), {"__module__": __name__})
    return dataclasses.dataclass(kw_only=True)(combined)


def trl_refusals(args) -> dict[str, tuple[bool, str]]:
    """The TRL config fields no nxd_hf trainer honours, for ``refuse_set_fields``."""
    return {
        "activation_offloading": (args.activation_offloading, "drop it (gradient_checkpointing checkpoints every "
                                  "layer with nxd_hf)"),
        "use_liger_kernel": (args.use_liger_kernel, "drop it: nxd_hf's parallel layers replace the kernels"),
    }


def refuse_set_fields(trainer: str, refused: dict[str, tuple[bool, str]]) -> None:
    """A ValueError for the first of ``refused`` (field -> (whether it is set, what to do)) that is set."""
    for name, (is_set, fix) in refused.items():
        if is_set:
            raise ValueError(f"{name} is not supported by nxd_hf.{trainer}: {fix}")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _specialized(where: str) -> type:
    import importlib

    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)
