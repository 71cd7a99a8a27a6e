"""nxd_hf for ``transformers.Trainer`` subclasses: ``parallel_trainer`` / ``parallel_arguments``
(any subclass), TRL's ``NxDSFTTrainer`` / ``NxDSFTConfig`` (``nxd_hf.integrations.trl``) and
``NxDDPOTrainer`` / ``NxDDPOConfig`` (``nxd_hf.integrations.dpo``), ``NxDRewardTrainer`` /
``NxDRewardConfig`` (``nxd_hf.integrations.reward``; TRL is an optional extra). All imported on
first use."""

_LAZY = {"parallel_trainer": "nxd_hf.integrations.subclass", "parallel_arguments": "nxd_hf.integrations.subclass",
         "NxDSFTTrainer": "nxd_hf.integrations.trl", "NxDSFTConfig": "nxd_hf.integrations.trl",
         "NxDDPOTrainer": "nxd_hf.integrations.dpo", "NxDDPOConfig": "nxd_hf.integrations.dpo",
         "NxDRewardTrainer": "nxd_hf.integrations.reward", "NxDRewardConfig": "nxd_hf.integrations.reward"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nxd_hf.integrations' has no attribute {name!r}")


__all__ = sorted(_LAZY)
