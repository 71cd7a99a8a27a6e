"""``save_checkpoint`` (NxD's ``neuronx_distributed.trainer.save_checkpoint``).

Not ``torch.distributed.checkpoint``: DCP's Hugging Face writer keeps one chunk per key and
rank, which silently loses data when a rank holds several runs of one tensor (padding,
strided fused QKV, replicated K/V), and its default writer stores ``.distcp`` files that
``from_pretrained`` cannot open. Here each rank writes safetensors parts in logical
coordinates under the on-disk HF names (``nxd_hf.checkpoint.logical``), so a checkpoint
reshards by reading other slices, and consolidation is a concatenation.
"""

import contextlib
import copy
import io
import json
import os
import random
import shutil
import warnings

import numpy as np
import torch

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import optim_state, owner, store, writer
from nxd_hf.checkpoint.format import dtype_name, parts_of
from nxd_hf.checkpoint.logical import adapters_of, hf_model, logical_tensors, model_config
from nxd_hf.model_state import state_of
from nxd_hf.parallel_layers.random import get_rng_state_tracker
from nxd_hf.guards.fail_together import fail_together

OPTIM_SEP = "::"
"""Optimizer state tensor names: ``<parameter's on-disk name>::<state key>``."""


def parallel_sizes(optimizer=None) -> dict:
    """The header's layout: ``parallel_state``'s ``ParallelSizes``, the launched world (the same
    unless a job saves without initializing ``parallel_state``) and whether ZeRO-1 sharded the state."""
    return {**parallel_state.get_parallel_sizes().as_dict(), "world": backend.world_size(),
            "zero1": optimizer is not None and optim_state.shards_state(optimizer)}


def rng_state() -> dict:
    """This process's RNG states (torch, Python, numpy, the model-parallel tracker), in types
    ``torch.load(weights_only=True)`` reads back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
             "tracker": dict(get_rng_state_tracker().states)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _nxd_config(model, nxd_config):
    """The config API's config: the one passed, else the one the model was wrapped with."""
    state = state_of(model)
    return nxd_config if nxd_config is not None or state is None else state.nxd_config


def _master_weights_in_ckpt(nxd_config) -> bool:
    precision = getattr(nxd_config, "mixed_precision_config", None)  # NxDConfig or NxD's dict form
    if isinstance(precision, dict):
        return bool(precision.get("use_master_weights_in_ckpt", False))
    return bool(getattr(precision, "use_master_weights_in_ckpt", False))


def _tensor_shares(lts, optimizer, masters_in_model: bool, rank: int, copy: bool):
    """({file: {key: tensor}}, records) this rank writes."""
    model_file, optim_file = f"model/rank_{rank:05d}.safetensors", f"optim/rank_{rank:05d}.safetensors"
    files, records = {model_file: {}, optim_file: {}}, []
    states = optim_state.param_states(optimizer) if optimizer is not None else {}
    by_id = {id(lt.tensor): lt for lt in lts}
    unknown = [p for p, _ in states.values() if id(p) not in by_id]
    if unknown:
        raise ValueError(f"the optimizer has {len(unknown)} parameters that are not in the model passed to "
                         "save_checkpoint: pass the model the optimizer was built on")

    def add(section, file, lt, value, name):
        for key, tensor, part in parts_of(lt, value, name, file):
            files[file][key] = tensor.clone() if copy else tensor
            records.append([section, name, list(lt.shape) if tensor.dim() else [], dtype_name(tensor.dtype), part])

    with_state = set()  # a tensor in two sections (a trained bias of a LoRA base) has its state once
    for lt in lts:
        state = states.get(id(lt.tensor), (None, {}))[1]
        value = state.get(optim_state.MASTER, lt.tensor) if masters_in_model else lt.tensor
        add(lt.section, model_file, lt, value, lt.name)
        if id(lt.tensor) in with_state:
            continue
        with_state.add(id(lt.tensor))
        for key, tensor in state.items():
            add("optimizer", optim_file, lt, tensor, f"{lt.name}{OPTIM_SEP}{key}")
    return files, records


def _blobs(rank: int, optimizer, scheduler, user_content) -> dict:
    blobs = {f"rng/rank_{rank:05d}.pt": rng_state()}
    if rank == 0:
        groups = None
        if optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        blobs["state.pt"] = {"user_content": user_content, "param_groups": groups,
                             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    return blobs


def _header(model, optimizer, masters_in_model: bool, adapters_plan) -> dict:
    config = model_config(model) if model is not None else None
    return {"format": store.FORMAT, "version": 1, "parallel": parallel_sizes(optimizer),
            "model_type": getattr(config, "model_type", None),
            "config": json.loads(config.to_json_string()) if hasattr(config, "to_json_string") else None,
            "master_weights_in_model": masters_in_model, "adapters": adapters_plan}


def _write_configs(model, tmp: str) -> None:
    """config.json / generation_config.json, for consolidation."""
    config = model_config(model)
    if hasattr(config, "save_pretrained"):
        if hasattr(config, "architectures"):
            # As transformers' save_pretrained: the class saved names the head that from_pretrained
            # and pipelines build (a hub config may still name the base class it was trained from).
            config.architectures = [type(hf_model(model)).__name__.removeprefix("FSDP")]
        config.save_pretrained(tmp)
    generation = getattr(hf_model(model), "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(tmp)


README = """# An nxd_hf checkpoint

Written by `nxd_hf.save_checkpoint` (or `NxDTrainer`): safetensors parts in logical coordinates
with the optimizer, scheduler and RNG states. It is not a Hugging Face model directory, so
`from_pretrained` cannot open it. To get one (a LoRA checkpoint saved with the adapter alone
holds a peft adapter in its adapter directory instead):

    nxd-hf consolidate {directory} hf_model       # or nxd_hf.consolidate({path!r}, "hf_model", tag={tag!r})

To resume: `nxd_hf.load_checkpoint({path!r}, tag={tag!r}, model=..., optimizer=...)`, or
`NxDTrainer.train(resume_from_checkpoint=...)`, at these or any other parallel sizes.
"""


def _write_readme(path: str, tag: str, tmp: str) -> None:
    """What this directory is and how to open it, for whoever finds it (``from_pretrained`` cannot)."""
    directory = os.path.join(path, store.dir_name(tag))
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(README.format(directory=directory, path=path, tag=store.dir_name(tag)))


def _what_to_save(model, adapters, nxd_config) -> tuple[dict | None, list]:
    """(the adapters' save plan or None, the ``LogicalTensor``s to write)."""
    if model is None:
        return None, []
    if adapters is None:
        return None, logical_tensors(model)
    plan = adapters.save_plan(nxd_config)
    return plan, adapters.logical_tensors(model, plan, loading=False)


def _unloadable(obj, where: str = "user_content") -> str | None:
    """Where ``obj`` holds something ``torch.load(weights_only=True)`` cannot read back, or None."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return None
    except Exception as error:
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        else:
            return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__} ({type(error).__name__})"
        return next((p for k, v in items if (p := _unloadable(v, f"{where}[{k!r}]"))), f"{where}: {error}")


def _check_same_target(path: str, tag: str, user_content, job_id: str | None) -> tuple[str, str]:
    """Every rank must write into one directory (rank 0 assembles it), and rank 0's
    ``user_content`` must load back: a ValueError on every rank otherwise (one gather), instead
    of a missing part found later or a checkpoint marked complete that cannot load. Returns
    (the job, this save's id): rank 0's, for every rank."""
    unloadable, job = None, None
    if backend.rank() == 0:
        unloadable = _unloadable(user_content) if user_content is not None else None
        job = job_id or owner.this_job()
    gathered = backend.all_gather_object((os.path.abspath(path), tag, unloadable, job,
                                          owner.new_save_id(job) if job else None))
    targets, (unloadable, job, save_id) = {g[:2] for g in gathered}, gathered[0][2:]
    if len(targets) > 1:
        raise ValueError(f"save_checkpoint: the ranks were given different (path, tag): {sorted(targets)}; "
                         "every rank must pass the same path (on a filesystem all ranks share) and tag")
    if unloadable is not None:
        raise ValueError(f"save_checkpoint: {unloadable}, which torch.load(weights_only=True) cannot read back, "
                         "so the checkpoint could not be loaded. Store plain data in user_content (tensors, numbers, "
                         "strings, lists, dicts), e.g. obj.state_dict() or vars(obj), and rebuild the object on load")
    return job, save_id


def save_checkpoint(path: str, tag: str = "", model=None, optimizer=None, scheduler=None, user_content=None,
                    num_workers: int = 8, use_xser: bool = False, num_kept_ckpts: int | None = None,
                    async_save: bool = False, zero1_optimizer: bool = False, nxd_config=None,
                    side_files=None, job_id: str | None = None) -> None:
    """Save a checkpoint to ``path/tag`` (every rank calls it). As NxD's, except: the format
    is always safetensors in logical coordinates (``use_xser`` is ignored, with a warning),
    tag ``""`` is stored as ``path/default``, ``zero1_optimizer`` is detected from the
    optimizer object (NxD's optimizer-state-dict form is not accepted), and the checkpoint
    loads at any parallel sizes. ``user_content`` must hold only what
    ``torch.load(weights_only=True)`` reads back (tensors, numbers, strings, lists, dicts).
    ``num_workers``: ranks writing at the same time (synchronous saves). ``side_files(directory)``
    (not in NxD): rank 0 writes more files into the checkpoint before it is complete, so the
    completion marker covers them (``NxDTrainer``'s trainer state and tokenizer).
    ``job_id`` (not in NxD): the job writing (default: an id rank 0 of this process makes once). One job
    at a time writes a directory (``nxd_hf.checkpoint.owner``): a second job's save is refused on
    every rank unless the first finished or this job resumed from it.

    A LoRA model (``lora_config`` of ``parallelize`` / the config API) is saved as its
    ``LoraConfig`` says (``nxd_config.lora_config``, else the model's): the adapter alone
    (default), the base model and the adapter, or the base with the adapter merged in (for the
    saved copy only); see ``nxd_hf.lora.checkpoint``."""
    if use_xser:
        warnings.warn("save_checkpoint: use_xser is ignored: nxd_hf always writes safetensors", stacklevel=2)
    if isinstance(optimizer, dict):
        raise ValueError("save_checkpoint takes the optimizer object, not its state_dict")
    if num_workers < 1 or (num_kept_ckpts is not None and num_kept_ckpts < 1):
        raise ValueError(f"num_workers ({num_workers}) and num_kept_ckpts ({num_kept_ckpts}) must be >= 1")
    writer.wait_for_checkpoint()
    rank, world = backend.rank(), backend.world_size()
    job, save_id = _check_same_target(path, tag, user_content, job_id)
    with fail_together(f"save_checkpoint({path!r}, tag={tag!r})"):  # before anything is written
        if rank == 0:
            owner.claim(path, job)
    tmp = store.tmp_dir(path, tag)
    nxd_config = _nxd_config(model, nxd_config)
    masters_in_model = _master_weights_in_ckpt(nxd_config)
    adapters = adapters_of(model)
    plan, lts = _what_to_save(model, adapters, nxd_config)
    files, records = _tensor_shares(lts, optimizer, masters_in_model, rank, copy=async_save)
    backend.materialize()  # XLA: one compiled graph for every share, not one per tensor read to the host
    blobs = {rel: {**blob, "save": save_id} for rel, blob in _blobs(rank, optimizer, scheduler, user_content).items()}
    blobs = copy.deepcopy(blobs) if async_save else blobs  # the caller may change them while we write
    header = {**_header(model, optimizer, masters_in_model, plan), "job": job, "save": save_id}
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        store.remove_leftovers(path)  # of saves that crashed or ran out of disk
        os.makedirs(tmp)
        _write_readme(path, tag, tmp)
        if model is not None:
            _write_configs(model, tmp)
        if side_files is not None:
            side_files(tmp)
    backend.barrier()
    if adapters is not None:  # collective (gathers), before the completion marker
        adapters.write_files(model, tmp, plan)
    if async_save:
        def work():
            writer.write_share(tmp, rank, files, blobs, records, save_id)
            if rank == 0:
                writer.wait_for_records(tmp, world, writer.ASYNC_TIMEOUT_S)
                store.finalize(path, tag, writer.merge(tmp, world, header), num_kept_ckpts)
        writer.submit(work, path=path, tag=tag)
        return
    with _cleaned_up_on_failure(tmp):
        for wave in range(-(-world // num_workers)):
            with fail_together(f"save_checkpoint({path!r}, tag={tag!r})"):  # also the wave's barrier
                if rank // num_workers == wave:
                    writer.write_share(tmp, rank, files, blobs, records, save_id)
        with fail_together(f"save_checkpoint({path!r}, tag={tag!r})"):
            if rank == 0:
                store.finalize(path, tag, writer.merge(tmp, world, header), num_kept_ckpts)


@contextlib.contextmanager
def _cleaned_up_on_failure(tmp: str):
    """A failed save (a full disk, ...) deletes its temporary directory (rank 0) before the
    error propagates; earlier checkpoints are untouched."""
    try:
        yield
    except BaseException:
        if backend.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
