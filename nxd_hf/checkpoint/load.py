"""``load_checkpoint`` (NxD's ``neuronx_distributed.trainer.load_checkpoint``), at any
parallel sizes.

Everything that can be wrong is checked collectively before any rank reads a tensor: each
rank looks for problems (the directory, the completion marker, the index, its share of the
files' sizes and checksums, the model's tensors against the index), the problems are
gathered, and every rank raises the same ``ValueError`` naming them. Then each rank reads
the rows it holds and copies them in place into its parameters and optimizer state.
"""

import os
import random
import warnings

import numpy as np
import torch
from safetensors import safe_open

from nxd_hf import backend
from nxd_hf.checkpoint import optim_state, owner, store, writer
from nxd_hf.checkpoint.format import Reader, file_problem
from nxd_hf.checkpoint.hf_safetensors import HFKeys
from nxd_hf.checkpoint.logical import adapters_of, hf_model, logical_tensors, model_config
from nxd_hf.checkpoint.save import OPTIM_SEP, parallel_sizes
from nxd_hf.guards.fail_together import failures_on_every_rank
from nxd_hf.parallel_layers.random import get_rng_state_tracker


def raise_collectively(problems: list[str], what: str, advice: str = "") -> None:
    """Every rank raises the same ValueError when any rank found a problem."""
    failures = failures_on_every_rank("\x1e".join(problems) if problems else None)
    everyone = sorted({p for text in failures.values() for p in text.split("\x1e")})
    if everyone:
        shown = "\n  ".join(everyone[:10]) + (f"\n  ... and {len(everyone) - 10} more" if len(everyone) > 10 else "")
        raise ValueError(f"cannot load checkpoint {what}:\n  {shown}" + (f"\nTo do: {advice}" if advice else ""))


def _locate(path: str, tag: str | None) -> tuple[str, dict]:
    directory, problem = store.resolve(path, tag)
    index = None
    if problem is None:
        index, problem = store.read_index(directory)
    marker = store.marker_save(directory) if problem is None else None  # None: a marker of an older version
    if problem is None and index.get("save") and marker is not None and marker != index["save"]:
        problem = (f"{os.path.join(directory, store.DONE)} was written by save {marker}, "
                   f"{os.path.join(directory, store.INDEX)} by save {index['save']}: {TWO_JOBS}")
    advice = store.what_to_do(path, directory) if problem and directory is not None else ""
    raise_collectively([problem] if problem else [], f"from {path} (tag={tag!r})", advice)
    owner.note_loaded(path, index)
    return directory, index


def _check_files(directory: str, index: dict) -> None:
    """Every file the index lists (tensors and metadata: state.pt, RNG states, config.json,
    trainer_state.json, ...) against its size and checksums, shared out over the ranks."""
    rank, world = backend.rank(), backend.world_size()
    problems = []
    for i, (rel, expected) in enumerate(sorted(index["files"].items())):
        if i % world == rank:
            problem = file_problem(os.path.join(directory, rel), expected) or _other_save(directory, rel, index)
            if problem:
                problems.append(f"file {os.path.join(directory, rel)} {problem}")
    raise_collectively(problems, f"{directory}", store.what_to_do(os.path.dirname(directory), directory))


TWO_JOBS = ("two jobs wrote into this checkpoint directory at once, so it holds files of both. Give each run its "
            "own output directory")


def _other_save(directory: str, rel: str, index: dict) -> str | None:
    """Whether file ``rel`` (a tensor file or a torch.save'd one of nxd_hf) was written by
    another save than the index (checkpoints of older versions carry no save id)."""
    save, file = index.get("save"), os.path.join(directory, rel)
    if not save:
        return None
    if "header_crc32" in index["files"][rel]:
        with safe_open(file, framework="pt") as f:
            found = (f.metadata() or {}).get(writer.SAVE_KEY)
    elif rel.endswith(".pt"):
        blob = torch.load(file, weights_only=False)
        if not isinstance(blob, dict) or "save" not in blob:  # not one of nxd_hf's blobs: a caller's side file
            return None
        found = blob["save"]
    else:
        return None
    return None if found == save else f"was written by save {found}, the index by save {save}: {TWO_JOBS}"


def verify_checkpoint(path: str, tag: str | None) -> str:
    """The directory of a complete, undamaged checkpoint (every file checked); the same
    ValueError on every rank otherwise. Every rank calls it."""
    directory, index = _locate(path, tag)
    _check_files(directory, index)
    return directory


def _resolver(model, index: dict):
    """Model parameter -> checkpoint name (in its section): its on-disk name, else (base model
    tensors) a tied weight's or a renamed key."""
    key_of = HFKeys(hf_model(model), index["tensors"].get("model", {}))

    def resolve(lt):
        if lt.name in index["tensors"].get(lt.section, {}):
            return lt.name
        return key_of(lt.model_name) if lt.section == "model" else None
    return resolve


def _check_model(model, index: dict, lts, resolved: list, strict: bool, directory: str) -> None:
    problems = []
    config, saved_type = model_config(model), index.get("model_type")
    here_type = getattr(config, "model_type", None)
    if saved_type and here_type and saved_type != here_type:
        problems.append(f"the checkpoint holds a {saved_type!r} model, this model is {here_type!r} (another architecture)")
    saved_vocab, vocab = (index.get("config") or {}).get("vocab_size"), getattr(config, "vocab_size", None)
    if saved_vocab is not None and vocab is not None and saved_vocab != vocab:
        problems.append(f"the checkpoint's vocab_size is {saved_vocab}, this model's is {vocab}")
    for lt, name in zip(lts, resolved):
        if name is None:
            if strict:
                where = "" if lt.section == "model" else f" ({lt.section} section)"
                problems.append(f"missing key: {lt.name} is not in the checkpoint{where} (strict=True)")
            continue
        saved = index["tensors"][lt.section][name]["shape"]
        if tuple(saved) != tuple(lt.shape):
            problems.append(f"{name} has shape {tuple(saved)} in the checkpoint but {tuple(lt.shape)} "
                            "in this model (another architecture or configuration)")
    used = {n for ns in backend.all_gather_object([(lt.section, n) for lt, n in zip(lts, resolved) if n]) for n in ns}
    sections = {s for ss in backend.all_gather_object(sorted({lt.section for lt in lts})) for s in ss} or {"model"}
    if strict:
        unexpected = sorted({(s, n) for s in sections for n in index["tensors"].get(s, {})} - {tuple(u) for u in used})
        unexpected = [n for _, n in unexpected]
        problems += [f"unexpected key: {n} is in the checkpoint but not in this model (strict=True)" for n in unexpected[:20]]
    raise_collectively(problems, f"{directory} into this model")


def _read_states(reader: Reader, index: dict, lts, resolved) -> dict[int, dict]:
    section = index["tensors"].get("optimizer", {})
    by_param = {}
    for name, entry in section.items():
        param_name, key = name.rsplit(OPTIM_SEP, 1)
        by_param.setdefault(param_name, []).append((key, entry))
    out = {}
    for lt, name in zip(lts, resolved):
        if id(lt.tensor) in out:  # in two sections (a LoRA model's trained bias): its state was saved once
            continue
        state = {}
        for key, entry in by_param.get(name, []):
            per_element = entry["shape"] == list(lt.shape) and bool(entry["shape"])
            like = torch.empty(lt.tensor.shape if per_element else (), dtype=torch.float32, device="meta")
            value = reader.local("optimizer", f"{name}{OPTIM_SEP}{key}", lt, like)
            state[key] = value.to(lt.tensor.device)
        if optim_state.MASTER not in state and index.get("master_weights_in_model") and name is not None:
            state[optim_state.MASTER] = reader.local(lt.section, name, lt, lt.tensor.float())
        out[id(lt.tensor)] = state
    return out


def _restore_non_tensor(directory: str, index: dict, optimizer, scheduler):
    state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
    if optimizer is not None and state["param_groups"] is not None:
        if len(state["param_groups"]) != len(optimizer.param_groups):
            warnings.warn(f"load_checkpoint: the checkpoint has {len(state['param_groups'])} optimizer param groups, "
                          f"this optimizer {len(optimizer.param_groups)}: their options (lr, ...) are not restored")
        else:
            for group, saved in zip(optimizer.param_groups, state["param_groups"]):
                group.update(saved)
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    return state["user_content"]


def _restore_rng(directory: str, index: dict) -> None:
    saved = {k: v for k, v in index["parallel"].items() if k != "zero1"}
    here = {k: v for k, v in parallel_sizes().items() if k != "zero1"}
    if saved != here:
        warnings.warn(f"load_checkpoint: RNG states not restored: saved at {saved}, loaded at {here}")
        return
    rng = torch.load(os.path.join(directory, f"rng/rank_{backend.rank():05d}.pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_rng_state_tracker().states = dict(rng["tracker"])


def restore_rng_states(path: str, tag: str | None = None) -> None:
    """Set this process's RNG states to those a checkpoint saved (at the same parallel sizes;
    ``load_checkpoint`` does it too). ``NxDTrainer`` calls it where ``Trainer`` restores them."""
    directory, index = _locate(path, tag)
    _restore_rng(directory, index)


def _resolve_and_check(model, index: dict, lts, strict: bool, directory: str) -> list:
    resolve = _resolver(model, index)
    resolved = [resolve(lt) for lt in lts]
    _check_model(model, index, lts, resolved, strict, directory)
    return resolved


def load_model_tensors(path: str, tag: str | None, model, lts, *, strict: bool = True) -> dict:
    """Copy the checkpoint's values of ``lts`` (``LogicalTensor``s of ``model``'s tensors) in
    place, checked as ``load_checkpoint`` checks; no optimizer, scheduler or RNG state. Every
    rank calls it. Returns the checkpoint's index (its header: e.g. "adapters")."""
    writer.wait_for_checkpoint()
    directory, index = _locate(path, tag)
    _check_files(directory, index)
    resolved = _resolve_and_check(model, index, lts, strict, directory)
    reader = Reader(directory, index)
    with torch.no_grad():
        for lt, name in zip(lts, resolved):
            if name is not None:
                lt.tensor.copy_(reader.local(lt.section, name, lt, lt.tensor))
    reader.close()
    backend.barrier()
    return index


def read_index(path: str, tag: str | None) -> tuple[str, dict]:
    """(directory, index) of a complete checkpoint; the same ValueError on every rank otherwise."""
    return _locate(path, tag)


def load_checkpoint(path: str, tag: str | None = None, model=None, optimizer=None, scheduler=None,
                    num_workers: int = 8, strict: bool = True):
    """Load a checkpoint written by ``save_checkpoint`` into ``model``/``optimizer``/``scheduler``
    in place (build the optimizer first, as with NxD) and return its ``user_content``.
    ``tag=None``: the newest complete checkpoint. Unlike NxD, any parallel sizes (tp, pp, dp,
    ZeRO-1 or not) load; RNG states are restored when the sizes are the saved ones. A LoRA
    model reads its adapters (and the base when it was saved unmerged): ``nxd_hf.lora.checkpoint``."""
    writer.wait_for_checkpoint()
    backend.barrier()
    directory, index = _locate(path, tag)
    _check_files(directory, index)
    adapters = adapters_of(model)
    if model is None:
        lts = []
    elif adapters is not None:
        lts = adapters.logical_tensors(model, index.get("adapters"), loading=True)
    else:
        lts = logical_tensors(model)
    resolved = _resolve_and_check(model, index, lts, strict, directory) if model is not None else []
    reader = Reader(directory, index)
    rank, world = backend.rank(), backend.world_size()
    states = None
    for wave in range(-(-world // num_workers)):
        if rank // num_workers == wave:
            with torch.no_grad():
                for lt, name in zip(lts, resolved):
                    if name is not None:
                        lt.tensor.copy_(reader.local(lt.section, name, lt, lt.tensor))
            if optimizer is not None:
                states = _read_states(reader, index, lts, resolved)
        backend.barrier()
    reader.close()
    if optimizer is not None:
        optim_state.load_param_states(optimizer, states)
    user_content = _restore_non_tensor(directory, index, optimizer, scheduler)
    _restore_rng(directory, index)
    backend.barrier()
    return user_content
