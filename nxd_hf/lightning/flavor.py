"""Which Lightning ``nxd_hf.lightning`` is built on: the ``pytorch_lightning`` package (NxD's
documents use it) or the unified ``lightning`` package (``import lightning as L``, Lightning's own
documents since 2.0). They ship the same code as distinct classes, so a strategy built on one is
refused by the other's ``Trainer``. The choice, made once at import:

1. ``NXD_HF_LIGHTNING=pytorch_lightning`` or ``=lightning``;
2. else the one the program imported already (``import lightning as L`` before
   ``from nxd_hf.lightning import NxDStrategy``);
3. else ``pytorch_lightning`` if installed, else ``lightning``."""

import importlib
import importlib.util
import os
import sys

PACKAGES = {"pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
            "lightning": ("lightning.pytorch", "lightning.fabric")}
"""flavor -> (its Trainer's package, its Fabric package)."""


def choose_flavor(requested: str | None, imported: set[str], installed: set[str]) -> str:
    """The rules above: ``requested`` is the environment variable, ``imported``/``installed``
    the flavors' top-level packages already in ``sys.modules`` / importable."""
    if requested:
        if requested not in PACKAGES:
            raise ValueError(f"NXD_HF_LIGHTNING={requested!r}: use 'pytorch_lightning' or 'lightning'")
        if requested not in installed:
            raise ValueError(f"NXD_HF_LIGHTNING={requested!r}, which is not installed: pip install {requested}")
        return requested
    loaded = [name for name in PACKAGES if name in imported]
    if len(loaded) == 1:
        return loaded[0]
    for name in PACKAGES:
        if name in installed:
            return name
    raise ImportError("nxd_hf.lightning needs PyTorch Lightning: pip install nxd_hf[lightning] (or the "
                      "unified package: pip install lightning)")


FLAVOR = choose_flavor(os.environ.get("NXD_HF_LIGHTNING"), set(sys.modules) & set(PACKAGES),
                       {name for name in PACKAGES if importlib.util.find_spec(name) is not None})
_trainer_package, _fabric_package = PACKAGES[FLAVOR]

pl = importlib.import_module(_trainer_package)
"""``pytorch_lightning`` or ``lightning.pytorch``."""
ParallelStrategy = importlib.import_module(f"{_trainer_package}.strategies").ParallelStrategy
Precision = importlib.import_module(f"{_trainer_package}.plugins.precision").Precision
TQDMProgressBar = importlib.import_module(f"{_trainer_package}.callbacks").TQDMProgressBar
TensorBoardLogger = importlib.import_module(f"{_trainer_package}.loggers").TensorBoardLogger
rank_zero_only = importlib.import_module(f"{_trainer_package}.utilities.rank_zero").rank_zero_only
fabric_rank_zero_only = importlib.import_module(f"{_fabric_package}.utilities.rank_zero").rank_zero_only
ClusterEnvironment = importlib.import_module(f"{_fabric_package}.plugins.environments").ClusterEnvironment
