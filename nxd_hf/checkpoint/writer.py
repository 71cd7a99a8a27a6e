"""Writing one rank's share of a checkpoint, synchronously or on a background thread.

A rank writes its safetensors files and its non-tensor files, then ``records/rank_N.json``
(its part records and file checksums) last. Rank 0 merges every rank's records into the
index. With ``async_save`` the writing runs on a (non-daemon) thread that uses no process
group: rank 0's thread waits for the other ranks' record files on the shared filesystem
instead of a barrier. ``wait_for_checkpoint`` joins it; the next save and load, the end of
``parallel_state.destroy_model_parallel`` and interpreter exit (a non-daemon thread) wait too.
"""

import glob
import io
import json
import os
import threading
import time

import torch

from nxd_hf import parallel_state
from nxd_hf.checkpoint import store
from nxd_hf.checkpoint.format import file_checksum, write_file

RECORDS = "records"
SAVE_KEY = "nxd_hf_save"
"""The key of the save id in a tensor file's safetensors metadata."""
ASYNC_TIMEOUT_S = 3600.0
"""How long rank 0's background thread waits for the other ranks' files before giving up
(the checkpoint then stays an invisible temporary directory)."""

_pending: list[threading.Thread] = []
_errors: list[BaseException] = []
_saves: list[tuple[str, str]] = []  # (path, tag) of this process's asynchronous saves not yet seen complete


def record_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, RECORDS, f"rank_{rank:05d}.json")


def write_share(tmp: str, rank: int, files: dict[str, dict], blobs: dict[str, object], records: list,
                save_id: str) -> None:
    """Write this rank's tensor files (``save_id`` in their headers), ``blobs`` (torch.save'd),
    then its record file."""
    meta = {}
    for rel, tensors in files.items():
        if tensors:
            meta[rel] = write_file(os.path.join(tmp, rel), tensors, metadata={SAVE_KEY: save_id})
    for rel, obj in blobs.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with store.durable_open(path, "wb") as f:
            f.write(buffer.getvalue())
    os.makedirs(os.path.join(tmp, RECORDS), exist_ok=True)
    store.write_json_atomic(record_path(tmp, rank), {"files": meta, "records": records, "save": save_id})


def merge(tmp: str, world: int, header: dict) -> dict:
    """The index from every rank's record file."""
    tensors, files, others = {}, {}, []
    for rank in range(world):
        with open(record_path(tmp, rank)) as f:
            share = json.load(f)
        if share.get("save") != header["save"]:
            others.append(f"rank {rank}: {share.get('save')}")
            continue
        files.update(share["files"])
        for section, name, shape, dtype, part in share["records"]:
            part["crc32"] = share["files"][part["file"]]["crc32"][part["key"]]
            entry = tensors.setdefault(section, {}).setdefault(name, {"shape": shape, "dtype": dtype, "parts": []})
            assert entry["shape"] == shape, f"{name}: ranks disagree on its shape"
            entry["parts"].append(part)
    if others:
        raise ValueError(f"{tmp} holds files of another save ({', '.join(others)}; this save is {header['save']}): "
                         "two jobs are saving into one checkpoint directory. Give each run its own output directory")
    for section in tensors.values():
        for name, entry in section.items():
            _check_coverage(name, entry)
    files.update(_other_files(tmp, set(files)))
    return {**header, "tensors": tensors, "files": files}


def _other_files(tmp: str, known: set[str]) -> dict:
    """Checksums of every other file in the checkpoint (state.pt, RNG states, config.json,
    trainer_state.json, adapters, tokenizer, ...): loading checks them as it checks tensors."""
    out = {}
    for root, _, names in os.walk(tmp):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), tmp)
            if rel not in known and rel.split(os.sep)[0] != RECORDS and rel not in (store.INDEX, store.DONE):
                out[rel] = file_checksum(os.path.join(tmp, rel))
    return out


def _check_coverage(name: str, entry: dict) -> None:
    """Every logical row is written exactly once (the ownership rules' invariant)."""
    parts = entry["parts"]
    if len(parts) == 1 and parts[0]["dim"] is None:
        return
    assert all(p["dim"] is not None for p in parts), f"{name}: written whole and in parts"
    if not any("inner" in p for p in parts):
        _check_spans(name, [(p["start"], p["stop"]) for p in parts], entry["shape"][parts[0]["dim"]])
        return
    assert all("inner" in p for p in parts), f"{name}: written in boxes and in rows"
    boxes = {}  # boxes along two dims: (start, stop) -> the inner spans written of these rows
    for p in parts:
        boxes.setdefault((p["start"], p["stop"]), []).append(tuple(p["inner"][1:]))
    _check_spans(name, list(boxes), entry["shape"][parts[0]["dim"]])
    for (start, stop), inner in boxes.items():
        _check_spans(f"{name} rows {start}..{stop}", inner, entry["shape"][parts[0]["inner"][0]])


def _check_spans(name: str, spans: list[tuple[int, int]], size: int) -> None:
    expected = 0
    for start, stop in sorted(spans):
        assert start == expected, f"{name}: rows {expected}..{start} missing or written twice"
        expected = stop
    assert expected == size, f"{name}: rows {expected}..{size} missing"


def wait_for_records(tmp: str, world: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(glob.glob(os.path.join(tmp, RECORDS, "rank_*.json"))) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"async checkpoint {tmp}: not every rank finished writing in {timeout_s}s")
        time.sleep(0.05)


def submit(work, *, path: str, tag: str) -> None:
    """Run ``work`` (writing the save of ``path``/``tag``) on a background thread."""
    _saves.append((path, tag))

    def run():
        try:
            work()
        except BaseException as error:  # re-raised by wait_for_checkpoint
            _errors.append(error)

    thread = threading.Thread(target=run, name="nxd_hf-async-checkpoint", daemon=False)
    thread.start()
    _pending.append(thread)


def wait_for_checkpoint() -> None:
    """Block until every background checkpoint write of this process has finished; raise the
    first error one of them hit."""
    while _pending:
        _pending.pop(0).join()
    if _errors:
        error = _errors.pop(0)
        _errors.clear()
        raise RuntimeError(f"an asynchronous checkpoint save failed: {error}") from error


parallel_state.register_before_destroy(wait_for_checkpoint)


def wait_for_saves_into(path: str) -> None:
    """Before reading ``path`` without the other ranks (``consolidate``): wait for this process's
    saves into it, including rank 0's finishing them, which another rank sees only on disk."""
    wait_for_checkpoint()
    deadline = time.monotonic() + ASYNC_TIMEOUT_S
    for saved_path, tag in [s for s in _saves if os.path.realpath(s[0]) == os.path.realpath(path)]:
        tmp, final = store.tmp_dir(saved_path, tag), os.path.join(saved_path, store.dir_name(tag))
        # rank 0 renames the temporary directory into place, then records the tag: wait for both
        while os.path.isdir(tmp) or (os.path.isdir(final) and tag not in store.read_tracker(saved_path)["complete"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the asynchronous save into {tmp} did not finish in {ASYNC_TIMEOUT_S}s")
            time.sleep(0.05)
        _saves.remove((saved_path, tag))
