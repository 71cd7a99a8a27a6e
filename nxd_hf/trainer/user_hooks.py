"""A user's subclass of ``NxDTrainer`` (``class MyTrainer(nxd_hf.NxDTrainer)``, the usual way to
customize ``Trainer``): what ``Trainer`` would run of it, ``NxDTrainer`` runs.

- ``compute_loss``: ``Trainer``'s training step calls it, so ``NxDTrainer``'s does
  (``runs_own_compute_loss``), with the step's ``num_items_in_batch`` as nxd_hf normalizes it
  over data parallelism; ``super().compute_loss`` is ``Trainer``'s, on the parallel model.
- Under pipeline parallelism only the schedule runs the model: an override of a hook that runs
  the model (``compute_loss``, ``prediction_step``, ``evaluate``, ...) would not, so it is refused
  when the trainer is built, with the hooks named.

``nxd_hf.parallel_trainer``'s compositions with another ``Trainer`` subclass have their own rule
(``nxd_hf.integrations.subclass``); this one covers the classes a user writes on top of
``NxDTrainer`` or of those compositions.
"""

import transformers

MODEL_RUNNING = ("compute_loss", "prediction_step", "evaluate", "evaluation_loop", "predict")


def user_overrides(trainer_cls: type, nxd_trainer_cls: type) -> dict[str, str]:
    """Hooks running the model that a class ahead of ``nxd_trainer_cls`` in ``trainer_cls``'s method
    order, other than nxd_hf's own, defines: name -> "module.Class.name"."""
    found = {}
    mro = trainer_cls.__mro__
    for klass in mro[:mro.index(nxd_trainer_cls)]:
        if klass.__module__.startswith("nxd_hf."):
            continue
        for name in set(MODEL_RUNNING) & set(vars(klass)):
            found.setdefault(name, f"{klass.__module__}.{klass.__qualname__}.{name}")
    return found


def check_user_overrides(trainer_cls: type, nxd_trainer_cls: type, *, pipelined: bool) -> None:
    """ValueError at pipeline parallelism for the overrides ``user_overrides`` finds."""
    found = user_overrides(trainer_cls, nxd_trainer_cls)
    if pipelined and found:
        raise ValueError(f"{trainer_cls.__name__} overrides {', '.join(sorted(found.values()))}, which run the model; "
                         "under pipeline parallelism only the schedule runs it, so the override would not. Move "
                         "the logic to a TrainerCallback or to the model's forward, or drop pipeline parallelism")


def runs_own_compute_loss(trainer) -> bool:
    """Whether ``trainer``'s class has a ``compute_loss`` of its own (``Trainer``'s otherwise)."""
    return type(trainer).compute_loss is not transformers.Trainer.compute_loss
