"""Load Hugging Face safetensors into a tensor-parallel model: each rank reads only its rows.

For a sharded parameter, the rows named by its ``shard_index`` are read with safetensors'
``get_slice`` in contiguous runs (padding rows become zeros, HF ``Conv1D`` weights are stored
``[in, out]`` and transposed after reading); replicated parameters are read whole. Bytes read
are counted (``LoadReport``), so tests can check that no rank reads more than its share.
A tensor read whole, or a shard that is one contiguous run of rows, stays what safetensors
returns, a copy-on-write view of the memory-mapped file (as transformers keeps its weights):
its pages are shared page cache until training writes them. Other shards are copied.
"""

import contextlib
import dataclasses
import json
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nxd_hf.checkpoint.fused_experts import fused_parameters, read_fused, read_stored_fused
from nxd_hf.parallel_layers.sharding import is_expert_parallel, is_sharded
from nxd_hf.utils import owners_of

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass
class LoadReport:
    bytes_read: int = 0
    """Bytes of tensor data this rank read from the files."""
    keys_read: int = 0
    """Checkpoint tensors this rank opened."""
    bytes_padding: int = 0
    """Bytes of padding rows (past a tensor's stored size, e.g. a vocabulary padded to a multiple
    of tp) this rank filled with zeros instead of reading: held, but in no file."""
    largest_bytes: int = 0
    """Bytes of the largest tensor the reader handed back (one read or one sharded slice): what
    loading holds beyond the model's own parameters at any time."""


def check_checkpoint_dir(path) -> None:
    """ValueError unless ``path`` is an existing directory (no hub download is attempted)."""
    if not os.path.isdir(path):
        raise ValueError(
            f"checkpoint directory {path!r} does not exist: nxd_hf.from_pretrained reads a local directory saved "
            "with save_pretrained and never downloads; fetch a hub model first, e.g. "
            "huggingface_hub.snapshot_download(repo_id), and pass the directory it returns")


@contextlib.contextmanager
def _naming_file(name: str):
    """safetensors' errors do not say which file: add it, and what to do."""
    try:
        yield
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError) as error:
        raise ValueError(f"cannot read {name}: {error}. The file is truncated or corrupted (an interrupted "
                         "download or copy?): save or download it again") from error


class SafetensorsCheckpoint:
    """The tensors of a HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with _naming_file(index), open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {key: os.path.join(path, name) for key, name in weight_map.items()}
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            single = os.path.join(path, SINGLE_FILE)
            with _naming_file(single), safe_open(single, framework="pt") as f:
                self.files = {key: single for key in f.keys()}
        else:
            raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}: save the model with save_pretrained()")
        self._handles = {}
        self.report = LoadReport()

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def _view(self, key: str):
        name = self.files[key]
        with _naming_file(name):
            if name not in self._handles:
                self._handles[name] = safe_open(name, framework="pt")
            return self._handles[name].get_slice(key)

    def _slice(self, key: str):
        self.report.keys_read += 1
        return self._view(key)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key`` (from the file header; reads no data)."""
        return tuple(self._view(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        with _naming_file(self.files[key]):
            tensor = self._slice(key)[:]
        self.report.bytes_read += tensor.numel() * tensor.element_size()
        return self._handed(tensor)

    def _handed(self, tensor: torch.Tensor) -> torch.Tensor:
        self.report.largest_bytes = max(self.report.largest_bytes, tensor.numel() * tensor.element_size())
        return tensor

    def read_rows(self, key: str, dim: int, rows: torch.Tensor, within: tuple[int, int, int] | None = None
                  ) -> torch.Tensor:
        """Rows ``rows`` (-1: zeros) of tensor ``key`` along ``dim``, reading contiguous runs;
        ``within`` (dim, start, stop): only that range along another dim (this rank's experts)."""
        view = self._slice(key)
        shape = list(view.get_shape())
        if within is not None:
            shape[within[0]] = within[2] - within[1]
        pieces, dtype = [], None
        for start, stop, is_padding in row_runs(rows):
            index = [slice(None)] * len(shape)
            if within is not None:
                index[within[0]] = slice(within[1], within[2])
            if is_padding:
                piece_shape = list(shape)
                piece_shape[dim] = stop - start
                pieces.append(("zeros", piece_shape))
                continue
            index[dim] = slice(start, stop)
            with _naming_file(self.files[key]):
                piece = view[tuple(index)]
            self.report.bytes_read += piece.numel() * piece.element_size()
            dtype = piece.dtype
            pieces.append(("data", piece))
        if len(pieces) == 1 and pieces[0][0] == "data":
            return self._handed(pieces[0][1])  # one run: keep the (copy-on-write) view of the mapped file
        dtype = dtype or torch.float32
        self.report.bytes_padding += sum(
            torch.Size(p).numel() for kind, p in pieces if kind == "zeros") * dtype.itemsize
        return self._handed(torch.cat([p if kind == "data" else torch.zeros(p, dtype=dtype) for kind, p in pieces],
                                      dim=dim))


def row_runs(rows: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Split ``rows`` into (start, stop, is_padding) runs of consecutive rows or of -1s.
    Vectorized: a Python list of every row (32k ints for a vocab) would cost a MiB of memory."""
    if len(rows) == 0:
        return []
    padding = rows < 0
    both_padding = padding[1:] & padding[:-1]
    consecutive = ~padding[1:] & ~padding[:-1] & (rows[1:] == rows[:-1] + 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (~(both_padding | consecutive)).nonzero().flatten() + 1])
    stops = torch.cat([starts[1:], torch.tensor([len(rows)])])
    runs = []
    for i, j in zip(starts.tolist(), stops.tolist()):
        first = int(rows[i])
        runs.append((0, j - i, True) if first < 0 else (first, first + j - i, False))
    return runs


class HFKeys:
    """Model name -> the key holding it among ``keys`` (a stored HF model's names) for
    ``hf_model`` (its base-model prefix, tied weights and HF's renames): see ``_checkpoint_key``.
    ``follow_ties=False`` (buffers): no tied weight's key."""

    def __init__(self, hf_model: nn.Module | None, keys):
        self.keys = keys
        self.prefix = getattr(hf_model, "base_model_prefix", "")
        self.renamed = HFRenames(hf_model, keys)
        self.tied = tied_weights(hf_model)

    def __call__(self, name: str, *, follow_ties: bool = True) -> str | None:
        return _checkpoint_key(self.keys, name, self.prefix, self.renamed, self.tied if follow_ties else {})


def tied_weights(hf_model: nn.Module | None) -> dict[str, str]:
    """HF's tied weights of ``hf_model`` (tied name -> source name) when it ties its embeddings, else {}."""
    tied = getattr(hf_model, "_tied_weights_keys", None) or {}  # transformers' class attribute
    ties_embeddings = getattr(getattr(hf_model, "config", None), "tie_word_embeddings", False)
    return tied if isinstance(tied, dict) and ties_embeddings else {}


def _checkpoint_key(checkpoint, name: str, prefix: str, renamed: "HFRenames",
                    tied: dict[str, str]) -> str | None:
    """The checkpoint key holding parameter ``name``: the same name, the name without the
    base-model prefix, for a tied weight the key of the weight it is tied to, or else one of
    HF's load-time renames (e.g. GPT-NeoX ``embed_out`` -> ``lm_head``)."""
    candidates = [c for c in (name, tied.get(name)) if c is not None]
    for candidate in candidates:
        if candidate in checkpoint:
            return candidate
        if prefix and candidate.startswith(prefix + "."):
            stripped = candidate[len(prefix) + 1 :]
            if stripped in checkpoint:
                return stripped
    for candidate in candidates:
        key = renamed.get(candidate)
        if key is not None:
            return key
    return None


class HFRenames:
    """Model name -> checkpoint key for HF's registered plain renames of this model type.
    Built on the first lookup: transformers then builds its conversion table for every
    architecture (~1 MiB of objects and compiled patterns), which a checkpoint saved under the
    current names never needs."""

    def __init__(self, hf_model: nn.Module | None, keys):
        self._hf_model, self._keys, self._mapping = hf_model, keys, None

    def get(self, name: str) -> str | None:
        if self._mapping is None:
            self._mapping = self._build()
        return self._mapping.get(name)

    def _build(self) -> dict[str, str]:
        if self._hf_model is None or not hasattr(self._hf_model, "config"):
            return {}
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import WeightRenaming

        conversions = extract_weight_conversions_for_model(self._hf_model) or []
        renames = [t for t in conversions if isinstance(t, WeightRenaming)]
        mapping = {}
        for key in self._keys:
            name = key
            for rename in renames:
                for source, target in zip(rename.source_patterns, rename.target_patterns):
                    name = re.sub(source, target, name)
            if name != key:
                mapping[name] = key
        return mapping


def parameter_keys(modules: list[nn.Module], checkpoint: SafetensorsCheckpoint, key_of: HFKeys,
                   hf_model: nn.Module | None, path: str, *, hf_name=None):
    """(named parameters, checkpoint key of each, per-expert sources of fused ones), after checking
    that every parameter is in the checkpoint with its logical shape (before any slice is read).
    ``hf_name(name)``: the HF model's name of a parameter of ``modules``, None for one the files
    do not hold (peft's adapters on a model whose base layers peft wrapped); default: the same."""
    named = [(name if hf_name is None else hf_name(name), param) for name, param in _named_parameters(modules)]
    named = [(name, param) for name, param in named if name is not None]
    keys = {name: key_of(name) for name, _ in named}
    fused = fused_parameters(hf_model if hf_model is not None else modules[0], named, keys, checkpoint)
    missing = [name for name, key in keys.items() if key is None and name not in fused]
    if missing:
        raise ValueError(f"{len(missing)} parameters are not in the checkpoint at {path}: {missing[:5]}")
    _check_shapes([(keys[name], logical_shape(param)) for name, param in named if name not in fused], checkpoint, path)
    return named, keys, fused


def _named_parameters(modules: list[nn.Module]):
    seen = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


def load_hf_safetensors(modules: nn.Module | list[nn.Module], path: str, *,
                        hf_model: nn.Module | None = None, device=None, parameters: bool = True) -> LoadReport:
    """Fill every parameter and persistent buffer of a (parallelized) model, or of a list of
    its modules under the model's names (pipeline stages), from ``path``. ``hf_model``: the HF
    model they were made from (default: ``modules``), for its renames, tied-weight keys and
    base-model prefix. ``device``: where the read slices go (None: the CPU). ``parameters=False``:
    check the parameters' keys and shapes but fill only the buffers (the parameters are read into
    their data-parallel shards once FSDP2 has sharded them: ``hf_dp_shards``)."""
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    checkpoint = SafetensorsCheckpoint(path)
    owners = owners_of(modules)
    key_of = HFKeys(hf_model if hf_model is not None else modules[0], checkpoint.files)
    named, keys, fused = parameter_keys(modules, checkpoint, key_of, hf_model, path)
    for name, param in named if parameters else ():
        key = keys[name]
        if name in fused:
            local = read_fused(checkpoint, fused[name], param)
        elif is_expert_parallel(param):  # stored fused (gpt-oss, an older consolidation)
            local = read_stored_fused(checkpoint, key, param)
        elif is_sharded(param):
            transposed = getattr(param, "hf_transposed", False)
            dim = 1 - param.partition_dim if transposed else param.partition_dim
            local = checkpoint.read_rows(key, dim, param.shard_index)
            local = local.t() if transposed else local
        else:
            local = checkpoint.read(key)
        new = nn.Parameter(local.to(device=device, dtype=param.dtype).contiguous(), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)  # sharding metadata
        for module, attr in owners[id(param)]:
            setattr(module, attr, new)
    for module in modules:
        _load_buffers(module, checkpoint, key_of, device)
    return checkpoint.report


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of ``param`` as a HF checkpoint stores it (Conv1D weights ``[in, out]``)."""
    shape = list(param.shape)
    if is_sharded(param):
        shape[param.partition_dim] = param.logical_size
    if is_expert_parallel(param):
        shape[0] = param.expert_logical_size
    return tuple(reversed(shape)) if getattr(param, "hf_transposed", False) else tuple(shape)


def _check_shapes(expected: list[tuple[str, tuple]], checkpoint: SafetensorsCheckpoint, path: str) -> None:
    """Every tensor's stored shape against the model's logical one, before any slice is read:
    a sharded read of a bigger tensor would otherwise load its first rows without a word."""
    wrong = [(key, stored, shape) for key, shape in expected if (stored := checkpoint.shape(key)) != shape]
    if wrong:
        listed = "; ".join(f"size mismatch for {key}: copying a param with shape {list(stored)} from checkpoint, "
                           f"the shape in current model is {list(shape)}" for key, stored, shape in wrong[:5])
        raise ValueError(
            f"{listed}. {len(wrong)} tensor(s) in {path} do not match the model built from its config.json: fix "
            "config.json (hidden_size, intermediate_size, vocab_size, head counts, ...) or use the config the "
            "weights were saved with")


def _load_buffers(model: nn.Module, checkpoint: SafetensorsCheckpoint, key_of: HFKeys, device=None) -> None:
    """Persistent buffers come from the file; meta non-persistent ones (RoPE ``inv_freq``) are
    left for the setup sequence to recompute (``nxd_hf.model_setup.materialize``)."""
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            persistent = name not in module._non_persistent_buffers_set
            key = key_of(full_name, follow_ties=False) if persistent else None
            if key is not None:
                _check_shapes([(key, tuple(buffer.shape))], checkpoint, checkpoint.files[key])
                module._buffers[name] = checkpoint.read(key).to(device=device, dtype=buffer.dtype)
