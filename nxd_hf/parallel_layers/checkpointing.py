"""NxD's deprecated ``parallel_layers.save`` / ``parallel_layers.load``: one ``torch.save`` file
per model-parallel rank, ``save_dir/tp_rank_XX_pp_rank_XX/checkpoint.pt``, written by the
data-parallel rank 0 of each model replica, as NxD documents. Use ``nxd_hf.save_checkpoint`` /
``nxd_hf.load_checkpoint`` instead (safetensors in logical coordinates, loadable at any
parallel sizes, optimizer and scheduler included); these two exist so NxD scripts run.
"""

import os
import warnings

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import is_sharded, shard_from_full

_FILE = "checkpoint.pt"


def _rank_dir(save_dir: str) -> str:
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(save_dir, f"tp_rank_{tp:02d}_pp_rank_{pp:02d}")


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(f"nxd_hf.parallel_layers.{name} is deprecated (as in NxD): use nxd_hf.{instead}, which also "
                  "saves the optimizer and loads at other parallel sizes", FutureWarning, stacklevel=3)


def save(state_dict: dict, save_dir: str, save_serially: bool = True, save_xser: bool = False,
         down_cast_bf16: bool = False) -> None:
    """Save ``state_dict`` (this rank's shards, as ``model.state_dict()`` gives them) from every
    model-parallel rank of data-parallel rank 0. Every rank calls it. ``save_serially``: one
    model-parallel rank writes at a time. ``save_xser`` is ignored (no torch-xla serialization)."""
    _deprecated("save", "save_checkpoint")
    if save_xser:
        warnings.warn("parallel_layers.save: save_xser is ignored (torch.save is used)", stacklevel=2)
    if down_cast_bf16:
        state_dict = _map_tensors(state_dict, lambda t: t.bfloat16() if t.is_floating_point() else t)
    writes = parallel_state.get_data_parallel_rank() == 0
    model_group = parallel_state.get_model_parallel_group()
    turns = backend.group_size(model_group) if save_serially else 1
    for turn in range(turns):
        if writes and (not save_serially or turn == parallel_state.get_model_parallel_rank()):
            directory = _rank_dir(save_dir)
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, _FILE)
            torch.save(_map_tensors(state_dict, lambda t: t.detach().cpu()), path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash never leaves a half-written checkpoint.pt
        if save_serially:
            backend.barrier(model_group)
    backend.barrier()


def load(load_dir: str, model_or_optimizer=None, model_key: str = "model", load_xser: bool = False,
         sharded: bool = True, model=None) -> dict:
    """Read this rank's file of a ``save`` (``sharded=False``: ``load_dir`` is one unsharded
    ``torch.save`` file or a directory holding ``checkpoint.pt``, whose ``model_key`` entry —
    or the whole dict — is sharded into the model here). Loads ``model_key`` into
    ``model_or_optimizer`` (``model=`` is the same argument) and returns the whole dict."""
    _deprecated("load", "load_checkpoint")
    target = model if model is not None else model_or_optimizer
    if load_xser:
        warnings.warn("parallel_layers.load: load_xser is ignored (torch.load is used)", stacklevel=2)
    if sharded:
        path = os.path.join(_rank_dir(load_dir), _FILE)
    else:
        path = load_dir if os.path.isfile(load_dir) else os.path.join(load_dir, _FILE)
    if not os.path.isfile(path):
        raise ValueError(f"parallel_layers.load: {path} does not exist; was {load_dir} written by "
                         f"parallel_layers.save{'' if sharded else ' (unsharded: pass the file)'}?")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if target is None:
        return checkpoint
    state = checkpoint.get(model_key, checkpoint) if isinstance(checkpoint, dict) else checkpoint
    if not sharded:
        if not isinstance(target, torch.nn.Module):
            raise ValueError("parallel_layers.load(sharded=False) loads into a model, not an optimizer")
        state = _shard_for(target, state)
    target.load_state_dict(state)
    return checkpoint


def _shard_for(model: torch.nn.Module, full: dict) -> dict:
    """``full`` (unsharded tensors under the model's names) cut to this rank's shards."""
    params = dict(model.named_parameters())
    missing = sorted(set(model.state_dict()) - set(full))
    if missing:
        raise ValueError(f"parallel_layers.load(sharded=False): the checkpoint lacks {missing[:5]}; its keys must "
                         "be the model's state_dict names")
    local = {}
    for name in model.state_dict():
        param = params.get(name)
        tensor = full[name]
        if param is not None and is_sharded(param):
            tensor = shard_from_full(tensor, param.partition_dim, param.shard_index)
        local[name] = tensor
    return local


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value
