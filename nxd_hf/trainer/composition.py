"""Which ``transformers.Trainer`` subclasses ``NxDTrainer`` may be composed with.

``NxDTrainer`` replaces Trainer's hooks (the training step, evaluation on the parallel model,
the optimizer, the data split, saving). A Trainer subclass placed before it in the method order
(``class T(SFTTrainer, NxDTrainer)``) overrides those replacements: its hooks run the model as
on one process (an evaluation loss from one shard's logits, no SFT metrics) and the numbers are
silently other ones. Placed after it by hand (``class T(NxDTrainer, SFTTrainer)``), its
overrides are never checked against the parallel path. ``nxd_hf.parallel_trainer`` (and
``nxd_hf.NxDSFTTrainer``) put NxDTrainer first and run or refuse each override; any other
composition is refused when the trainer is constructed, before any of its ``__init__`` runs."""

import transformers

CHECKED_ATTRIBUTE = "nxd_checks_overrides"
"""Set on ``nxd_hf.parallel_trainer``'s classes: they check every override of the other trainer."""


def check_composition(trainer_cls: type, nxd_trainer_cls: type) -> None:
    """ValueError when ``trainer_cls`` combines ``nxd_trainer_cls`` with another Trainer subclass
    other than through ``nxd_hf.parallel_trainer``."""
    mro = trainer_cls.__mro__
    others = [k for k in mro if issubclass(k, transformers.Trainer) and not issubclass(nxd_trainer_cls, k)
              and not issubclass(k, nxd_trainer_cls)]
    if not others:
        return
    position = mro.index(nxd_trainer_cls)
    ahead = [k for k in others if mro.index(k) < position]
    if not ahead and getattr(trainer_cls, CHECKED_ATTRIBUTE, False):
        return
    names = ", ".join(k.__name__ for k in others)
    if ahead:
        hooks = sorted({n for k in ahead for n in vars(k) if hasattr(transformers.Trainer, n) and not n.startswith("__")})
        why = (f"{', '.join(k.__name__ for k in ahead)} precede NxDTrainer in its method order, so "
               f"{', '.join(hooks) or 'its hooks'} replace nxd_hf's parallel training, evaluation and saving (other "
               "numbers, silently)")
    else:
        why = "composed by hand, the overrides of the other trainer are not checked against the parallel path"
    raise ValueError(
        f"{trainer_cls.__name__} combines NxDTrainer with {names}: {why}. Use nxd_hf.NxDSFTTrainer with "
        "nxd_hf.NxDSFTConfig for TRL's SFTTrainer, or nxd_hf.parallel_trainer(YourTrainer) with args of "
        "nxd_hf.parallel_arguments(YourConfig) for any other: NxDTrainer first, each override run on the parallel "
        "path or refused by name")
