"""``check_same_on_every_rank``: one all-gather at setup comparing what every rank was asked for,
so that different sizes, models or plans on some ranks are one ValueError naming each value that
differs and every rank's, on every rank, instead of a hang in the next collective
(``nxd_hf.parallelize``, ``nxd_hf.nnscaler.parallelize``)."""

import json
import zlib

from nxd_hf import backend, parallel_state


def check_same_on_every_rank(caller: str, values: dict, *, fix: str, noun: str | None = None, timeout=None,
                             gathered_too: dict | None = None) -> list[dict]:
    """ValueError unless every rank holds the same ``values`` (a value that is a dict is named by
    its keys that differ: a summary such as ``model_summary``'s); ``fix`` ends the message, ``noun``
    names what differs (default: the differing keys). ``gathered_too`` is gathered, not compared.
    Returns every rank's ``{**values, **gathered_too}``. Initializes torch.distributed from the
    torchrun environment if needed."""
    backend.init_process_group_from_env(parallel_state.as_timeout(timeout))
    everyone = backend.all_gather_object({**values, **(gathered_too or {})})
    differ, keys = [], []
    for key in values:
        seen = [ranks.get(key) for ranks in everyone]
        if all(v == seen[0] for v in seen):
            continue
        keys.append(key)
        if isinstance(seen[0], dict):
            inner = sorted({k for v in seen for k in v if any(w.get(k) != v.get(k) for w in seen)})
            differ.append(f"the {key} (keys {inner}) differs across ranks")
        else:
            differ.append(f"{key}: " + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(seen)))
    if differ:
        raise ValueError(f"{caller} was called with different {noun or ', '.join(keys)} on different ranks: "
                         + "; ".join(differ) + f". {fix}")
    return everyone


def model_summary(model) -> dict:
    """What must be the same model on every rank: its class and its config (a checksum per key)."""
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return {"model": type(model).__name__,
            "model config": {k: zlib.crc32(json.dumps(v, sort_keys=True, default=str).encode())
                             for k, v in config.items()}}
