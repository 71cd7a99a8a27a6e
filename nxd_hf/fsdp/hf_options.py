"""transformers' ``TrainingArguments(fsdp=..., fsdp_config=...)`` read as nxd_hf's
``data_parallel_sharding``: ``NxDTrainingArguments`` takes the user's FSDP request from
transformers' own fields and does it itself (FSDP2 over its data-parallel group, composed with
tensor parallelism), so accelerate never wraps the model.

``fsdp``: True / "full_shard" -> "zero3"; "shard_grad_op" -> "zero2"; "hybrid_shard" /
"hybrid_shard_zero2" -> "zero3" / "zero2" sharded over groups of ``fsdp_config["dp_shard_size"]``
DP ranks and replicated across them (HSDP; accelerate's ``ParallelismConfig`` name, required:
transformers' FSDP1 shards within a node, which nxd_hf does not know); "offload" -> the shards
in host memory (``data_parallel_offload``; alone it means "full_shard offload"); "auto_wrap" is
what nxd_hf always does (each transformer layer, HF's ``_no_split_modules``, is one FSDP group,
as transformers' default policy). ``fsdp_config``: ``version`` 2, ``reshard_after_forward``
(False: "zero2"), ``activation_checkpointing`` (every transformer layer), ``offload_params``
(accelerate's name for "offload"), ``dp_shard_size``, ``auto_wrap_policy``
TRANSFORMER_BASED_WRAP, ``min_num_params`` 0, ``state_dict_type``
FULL_STATE_DICT (``save_pretrained`` writes the plain HF model); ``transformer_layer_cls_to_wrap`` and
``cpu_ram_efficient_loading`` are accepted with a warning (not read); the rest is a ValueError.
"""

import dataclasses

from nxd_hf import backend

_MODES = {"full_shard": "zero3", "shard_grad_op": "zero2", "hybrid_shard": "zero3", "hybrid_shard_zero2": "zero2"}
_HYBRID = ("hybrid_shard", "hybrid_shard_zero2")
_REFUSED_OPTIONS = {
    "no_shard": "no_shard is plain data parallelism: drop fsdp (nxd_hf averages gradients over DP by default)",
}
_ACCEPTED_KEYS = ("version", "reshard_after_forward", "activation_checkpointing", "offload_params", "dp_shard_size",
                  "auto_wrap_policy",
                  "transformer_layer_cls_to_wrap", "min_num_params", "cpu_ram_efficient_loading", "state_dict_type")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFFsdpRequest:
    """What ``fsdp`` / ``fsdp_config`` ask of nxd_hf."""

    data_parallel_sharding: str | None
    """"zero3", "zero2", or None (no FSDP asked)."""
    activation_checkpointing: bool = False
    """``fsdp_config["activation_checkpointing"]``: recompute every transformer layer."""
    offload: bool = False
    """"offload" (or ``fsdp_config["offload_params"]``): the shards in host memory (``data_parallel_offload``)."""
    shard_size: int | None = None
    """HSDP's ``fsdp_config["dp_shard_size"]`` (``data_parallel_shard_size``); None: shard over every DP rank."""


def read_hf_fsdp(fsdp, fsdp_config) -> HFFsdpRequest:
    """Translate transformers' fields; a ValueError names what nxd_hf cannot do and the fix."""
    if not fsdp:
        if fsdp_config:
            raise ValueError("fsdp_config is given without fsdp: set fsdp='full_shard' (or 'shard_grad_op')")
        return HFFsdpRequest(data_parallel_sharding=None)
    options = fsdp.split() if isinstance(fsdp, str) else [str(getattr(o, "value", o)) for o in fsdp] \
        if isinstance(fsdp, (list, tuple)) else ["full_shard"]
    config = {k.removeprefix("fsdp_"): v for k, v in _config_dict(fsdp_config).items()}
    for option in options:
        if option in _REFUSED_OPTIONS:
            raise ValueError(f"NxDTrainingArguments: fsdp={option!r}: {_REFUSED_OPTIONS[option]} (docs/fsdp.md)")
        if option not in (*_MODES, "auto_wrap", "offload"):
            raise ValueError(f"NxDTrainingArguments: unknown fsdp option {option!r}: use 'full_shard', "
                             "'shard_grad_op', 'hybrid_shard' or 'hybrid_shard_zero2' (with 'auto_wrap', 'offload')")
    unknown = sorted(set(config) - set(_ACCEPTED_KEYS))
    if unknown:
        raise ValueError(f"NxDTrainingArguments: fsdp_config keys {unknown} are not supported by nxd_hf's FSDP; "
                         f"supported: {list(_ACCEPTED_KEYS)} (docs/fsdp.md)")
    modes = {_MODES[o] for o in options if o in _MODES} or {"zero3"}
    if len(modes) > 1:
        raise ValueError(f"NxDTrainingArguments: fsdp={fsdp!r} asks for both full_shard and shard_grad_op: pick one")
    mode = modes.pop()
    if "reshard_after_forward" in config:
        mode = "zero3" if _bool(config["reshard_after_forward"]) else "zero2"
    _check_values(config)
    shard_size = _hybrid_shard_size(options, config)
    if config.get("transformer_layer_cls_to_wrap"):
        backend.warn_once("fsdp_config transformer_layer_cls_to_wrap is not read: nxd_hf shards the transformer layers "
                          "HF's _no_split_modules names (the classes transformers picks by default)", stacklevel=3)
    if _bool(config.get("cpu_ram_efficient_loading", False)):
        backend.warn_once("fsdp_config cpu_ram_efficient_loading is not needed: nxd_hf.from_pretrained reads only "
                          "this rank's tensor-parallel shard on every rank", stacklevel=3)
    return HFFsdpRequest(data_parallel_sharding=mode,
                         activation_checkpointing=_bool(config.get("activation_checkpointing", False)),
                         offload="offload" in options or _bool(config.get("offload_params", False)),
                         shard_size=shard_size)


def _hybrid_shard_size(options: list[str], config: dict) -> int | None:
    hybrid = [o for o in options if o in _HYBRID]
    if not hybrid:
        if "dp_shard_size" in config:
            raise ValueError("NxDTrainingArguments: fsdp_config dp_shard_size is the shard group of hybrid sharding: "
                             "add 'hybrid_shard' (or 'hybrid_shard_zero2') to fsdp, or drop dp_shard_size")
        return None
    if "dp_shard_size" not in config:
        raise ValueError(f"NxDTrainingArguments: fsdp={hybrid[0]!r} needs fsdp_config['dp_shard_size']: the number of "
                         "data-parallel ranks each copy is sharded over (it must divide the data-parallel size)")
    size = int(config["dp_shard_size"])
    if size < 1:
        raise ValueError(f"NxDTrainingArguments: fsdp_config dp_shard_size must be >= 1, got {size}")
    return size


def _check_values(config: dict) -> None:
    if int(config.get("version", 2)) != 2:
        raise ValueError("NxDTrainingArguments: fsdp_config version 1 is not supported: nxd_hf runs FSDP2 (version 2)")
    policy = config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP" or int(config.get("min_num_params", 0)):
        raise ValueError("NxDTrainingArguments: nxd_hf shards each transformer layer as one FSDP group "
                         "(TRANSFORMER_BASED_WRAP): size-based wrapping (min_num_params) is not supported")
    if config.get("state_dict_type", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        raise ValueError("NxDTrainingArguments: fsdp_config state_dict_type: nxd_hf's checkpoints are its own sharded "
                         "safetensors in logical coordinates; drop state_dict_type (docs/checkpoints.md)")


def _config_dict(fsdp_config) -> dict:
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, str):
        import json

        with open(fsdp_config, encoding="utf-8") as f:
            return json.load(f)
    return dict(fsdp_config)


def _bool(value) -> bool:
    return str(value).lower() in ("true", "1", "yes")
