"""A plain Hugging Face model out of a checkpoint: ``consolidate`` and ``save_pretrained``.

``consolidate`` streams: it plans the output shards from the index's shapes, then reads,
writes and frees one output shard at a time (each tensor is a concatenation of its parts), so
memory stays near one ``max_shard_size`` however large the model. Unlike NxD/optimum-neuron's
consolidation it never loads every TP shard at once. Fused mixture-of-experts tensors are written
per expert, as transformers' own ``save_pretrained`` does (``fused_experts.split_fused``).
"""

import json
import os
import re
import shutil

import torch

from nxd_hf import backend
from nxd_hf.checkpoint import store, writer
from nxd_hf.checkpoint.format import Reader, file_problem, write_file
from nxd_hf.checkpoint.fused_experts import per_expert_converters, split_fused

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "vocab.txt", "added_tokens.json", "chat_template.jinja")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS | {"": 1}:
        raise ValueError(f"max_shard_size must be bytes or a size such as '5GB' or '500MiB', got {size!r}")
    return int(float(match.group(1)) * _UNITS.get(match.group(2).upper(), 1))


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _plan(entries: dict, dtype: torch.dtype | None, limit: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name in sorted(entries, key=_natural):
        entry = entries[name]
        itemsize = (dtype or getattr(torch, entry["dtype"])).itemsize
        nbytes = itemsize * int(torch.Size(entry["shape"]).numel())
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _open(checkpoint_dir: str, tag: str | None) -> tuple[str, dict]:
    directory, problem = store.resolve(checkpoint_dir, tag)
    if problem is None:
        index, problem = store.read_index(directory)
    if problem is not None:
        advice = f". To do: {store.what_to_do(checkpoint_dir, directory)}" if directory is not None else ""
        raise ValueError(f"cannot consolidate: {problem}{advice}")
    problems = [f"file {os.path.join(directory, rel)} {p}" for rel, meta in sorted(index["files"].items())
                if (p := file_problem(os.path.join(directory, rel), meta))]
    if problems:
        raise ValueError("cannot consolidate checkpoint {}: {}. To do: {}".format(
            directory, "; ".join(problems), store.what_to_do(checkpoint_dir, directory)))
    return directory, index


def _copy_side_files(directory: str, checkpoint_dir: str, output_dir: str, dtype: torch.dtype | None) -> None:
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        source = next((os.path.join(d, name) for d in (directory, checkpoint_dir) if os.path.exists(os.path.join(d, name))), None)
        if source is not None:
            shutil.copyfile(source, os.path.join(output_dir, name))
    config_path = os.path.join(output_dir, "config.json")
    if dtype is not None and os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
        config["dtype"] = str(dtype).removeprefix("torch.")
        store.write_json_atomic(config_path, config)


def _model_type(directory: str, checkpoint_dir: str) -> str | None:
    path = next((os.path.join(d, "config.json") for d in (directory, checkpoint_dir)
                 if os.path.exists(os.path.join(d, "config.json"))), None)
    if path is None:
        return None
    with open(path) as f:
        return json.load(f).get("model_type")


def consolidate(checkpoint_dir: str, output_dir: str, tag: str | None = None, max_shard_size: int | str = "5GB",
                dtype: torch.dtype | None = None) -> None:
    """Write the model of checkpoint ``checkpoint_dir`` (``tag``, default the newest) as a
    plain HF model directory: ``config.json``, ``generation_config.json`` and tokenizer files
    when the checkpoint holds them (in its tag directory or ``checkpoint_dir``),
    ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_size`` and
    ``model.safetensors.index.json``. ``dtype``: cast the weights (default: as saved).
    ``checkpoint_dir`` may also be one checkpoint's own directory (``out/checkpoint-18``).
    A save this process started with ``async_save=True`` is waited for."""
    writer.wait_for_saves_into(checkpoint_dir)
    directory, index = _open(checkpoint_dir, tag)
    entries = index["tensors"].get("model", {})
    if not entries and index.get("adapters"):
        raise ValueError(f"checkpoint {directory} holds a LoRA adapter only (PEFT format in "
                         f"{os.path.join(directory, index['adapters']['adapter_dir'])}): save with "
                         "LoraConfig(save_lora_base=True) for the base model, and merge_lora=True for a merged one")
    if not entries:
        raise ValueError(f"checkpoint {directory} holds no model tensors (it was saved without model=)")
    os.makedirs(output_dir, exist_ok=True)
    shards = _plan(entries, dtype, parse_size(max_shard_size))
    reader = Reader(directory, index)
    weight_map, total = {}, 0
    converters = per_expert_converters(_model_type(directory, checkpoint_dir))
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            tensor = reader.full("model", name)
            for key, value in split_fused(name, tensor, converters):  # per-expert names, as transformers writes
                tensors[key] = (value.to(dtype) if dtype is not None else value).contiguous()
                total += tensors[key].numel() * tensors[key].element_size()
                weight_map[key] = file
        write_file(os.path.join(output_dir, file + ".tmp"), tensors)  # from the tensors' memory, no copy
        os.replace(os.path.join(output_dir, file + ".tmp"), os.path.join(output_dir, file))
        del tensors
        reader.close()  # the mapped input pages go with their handles
    _copy_side_files(directory, checkpoint_dir, output_dir, dtype)
    store.write_json_atomic(os.path.join(output_dir, "model.safetensors.index.json"),
                            {"metadata": {"total_size": total}, "weight_map": weight_map})


def save_pretrained(model, save_directory: str, *, max_shard_size: int | str = "5GB", **kwargs) -> None:
    """``save_pretrained`` for a parallelized model from the running job: every rank calls it;
    each writes its slices, rank 0 consolidates them into a plain HF model directory that
    ``from_pretrained`` (transformers' or nxd_hf's, at any tp/pp) loads. Other
    ``save_pretrained`` options are not supported (ignored with a warning)."""
    from nxd_hf.checkpoint.logical import adapters_of
    from nxd_hf.checkpoint.save import save_checkpoint

    if adapters_of(model) is not None:
        raise ValueError(
            "this model has LoRA adapters, which a plain HF model directory cannot hold: save the adapter with "
            "nxd_hf.lora.save_adapter(model, directory) (PEFT format), or save_checkpoint with "
            "LoraConfig(save_lora_base=True, merge_lora=True) and nxd_hf.consolidate it for the merged model")
    if kwargs:
        import warnings

        warnings.warn(f"save_pretrained: options {sorted(kwargs)} are ignored for a parallelized model", stacklevel=2)
    staging = os.path.join(save_directory, ".nxd_hf_staging")
    save_checkpoint(staging, tag="model", model=model)
    if backend.rank() == 0:
        consolidate(staging, save_directory, max_shard_size=max_shard_size)
        shutil.rmtree(staging, ignore_errors=True)
    backend.barrier()
