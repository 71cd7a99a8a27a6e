"""The checkpoint directory protocol: what makes a checkpoint visible, and which is newest.

``<path>/<tag>/`` (tag ``""`` is stored as ``default``) is written as ``<path>/.<tag>.tmp/``;
once every rank's files are written, rank 0 writes ``index.json``, then the completion marker
``done``, renames the finished directory into place (an existing one is first moved to
``.<tag>.old`` and deleted afterwards) and finally records the tag in ``checkpoints.json``
(``{"newest": tag, "complete": [oldest, ..., newest]}``, written to a temporary file and
renamed). A process killed at any moment leaves every earlier checkpoint loadable: a
temporary directory is never read, and a crash between the two renames leaves the complete
``.<tag>.old``, which ``resolve`` falls back to.
"""

import contextlib
import glob
import json
import os
import shutil
import warnings
import zlib

INDEX = "index.json"
DONE = "done"
TRACKER = "checkpoints.json"
FORMAT = "nxd_hf.checkpoint"


def dir_name(tag: str) -> str:
    if not isinstance(tag, str) or "/" in tag or tag.startswith(".") or tag in ("..",):
        raise ValueError(f"tag must be a plain directory name (no '/', not starting with '.'), got {tag!r}")
    return tag or "default"


def tmp_dir(path: str, tag: str) -> str:
    return os.path.join(path, f".{dir_name(tag)}.tmp")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_open(path: str, mode: str = "wb", *, atomic: bool = False):
    """``open(path, mode)`` for writing whose content is on disk (flushed and fsync'd) when the
    block ends. ``atomic``: written under a temporary name and renamed into place, so a reader
    sees the old file or the whole new one, never part of it."""
    target = f"{path}.tmp.{os.getpid()}" if atomic else path
    with open(target, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def write_json_atomic(path: str, obj) -> None:
    with durable_open(path, "w", atomic=True) as f:
        json.dump(obj, f, indent=1)


def _tracker_crc(newest, complete) -> int:
    return zlib.crc32(json.dumps([newest, complete]).encode())


def write_tracker(path: str, newest, complete: list[str]) -> None:
    write_json_atomic(os.path.join(path, TRACKER),
                      {"newest": newest, "complete": complete, "crc32": _tracker_crc(newest, complete)})


def _tracker_problem(tracker: str) -> tuple[dict | None, str | None]:
    try:
        with open(tracker) as f:
            data = json.load(f)
        newest, complete = data["newest"], data["complete"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"cannot be read ({type(error).__name__}: {error})"
    if "crc32" in data and data["crc32"] != _tracker_crc(newest, complete):  # files of older versions have none
        return None, "does not match its checksum (corrupted)"
    return {"newest": newest, "complete": list(complete)}, None


def complete_tags(path: str) -> list[str]:
    """The tags of the complete checkpoints found on disk (a completion marker and an index),
    oldest first (by when their marker was written)."""
    found = []
    for done in glob.glob(os.path.join(path, "*", DONE)):
        directory = os.path.dirname(done)
        if os.path.exists(os.path.join(directory, INDEX)):
            found.append((os.path.getmtime(done), os.path.basename(directory)))
    return [tag for _, tag in sorted(found)]


def read_tracker(path: str) -> dict:
    """``checkpoints.json``; when it is unreadable or damaged, a warning and the complete
    checkpoints found on disk instead (the newest by its completion marker)."""
    tracker = os.path.join(path, TRACKER)
    if not os.path.exists(tracker):
        return {"newest": None, "complete": []}
    data, problem = _tracker_problem(tracker)
    if problem is None:
        return _existing(path, data)
    complete = complete_tags(path)
    warnings.warn(f"{tracker} {problem}: using the newest complete checkpoint found in {path} instead "
                  f"({complete[-1] if complete else 'none'}; complete: {complete}). Pass tag=... (or --tag) to "
                  "choose another; the next save rewrites the file", stacklevel=3)
    return {"newest": complete[-1] if complete else None, "complete": complete}


def _existing(path: str, tracker: dict) -> dict:
    """The tracker without checkpoints deleted since (``Trainer`` deletes all but the best at the
    end of a run with ``save_total_limit=1``)."""
    def exists(tag):
        name = dir_name(tag)
        return os.path.isdir(os.path.join(path, name)) or os.path.isdir(os.path.join(path, f".{name}.old"))

    complete = [t for t in tracker["complete"] if exists(t)]
    newest = tracker["newest"] if tracker["newest"] in complete else (complete[-1] if complete else None)
    return {"newest": newest, "complete": complete}


def remove_leftovers(path: str) -> None:
    """Delete what saves that died (a full disk, a killed process) left in ``path``: temporary
    checkpoint directories and temporary json files. ``.<tag>.old`` (a complete checkpoint a
    crash between two renames left) stays: ``resolve`` falls back to it."""
    for leftover in glob.glob(os.path.join(path, ".*.tmp")):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in glob.glob(os.path.join(path, f"{TRACKER}.tmp.*")):
        os.remove(leftover)


def _index_checksum(directory: str) -> dict:
    with open(os.path.join(directory, INDEX), "rb") as f:
        data = f.read()
    return {"index_size": len(data), "index_crc32": zlib.crc32(data)}


def index_problem(directory: str, data: bytes) -> str | None:
    """What is wrong with ``index.json``'s bytes against the checksum in the completion marker
    (markers of older versions hold none), or None."""
    with open(os.path.join(directory, DONE)) as f:
        lines = f.read().splitlines()
    if len(lines) < 2:
        return None
    try:
        expected = json.loads(lines[1])
    except ValueError:
        return f"its completion marker {os.path.join(directory, DONE)} is damaged"
    if expected != {"index_size": len(data), "index_crc32": zlib.crc32(data)}:
        return f"{os.path.join(directory, INDEX)} does not match the checksum in its completion marker (corrupted)"
    return None


def marker_save(directory: str) -> str | None:
    """The save id in a completion marker (None: a marker of an older version)."""
    with open(os.path.join(directory, DONE)) as f:
        lines = f.read().splitlines()
    try:
        return json.loads(lines[2]).get("save") if len(lines) > 2 else None
    except (ValueError, AttributeError):
        return "(damaged)"


def finalize(path: str, tag: str, index: dict, num_kept_ckpts: int | None) -> None:
    """Rank 0, once every rank's files are in the temporary directory: make it the checkpoint."""
    tmp, name = tmp_dir(path, tag), dir_name(tag)
    write_json_atomic(os.path.join(tmp, INDEX), index)
    with durable_open(os.path.join(tmp, DONE), "w") as f:  # the marker carries index.json's checksum and the save
        f.write(f"complete\n{json.dumps(_index_checksum(tmp))}\n{json.dumps({'save': index.get('save')})}\n")
    fsync_dir(tmp)
    final, old = os.path.join(path, name), os.path.join(path, f".{name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(path)
    tracker = read_tracker(path)
    complete = [t for t in tracker["complete"] if t != tag] + [tag]
    write_tracker(path, tag, complete)
    shutil.rmtree(old, ignore_errors=True)
    if num_kept_ckpts is not None:
        prune(path, num_kept_ckpts)


def prune(path: str, num_kept: int, keep: tuple[str, ...] = ()) -> None:
    """Delete the oldest complete checkpoints beyond ``num_kept`` (the tracker first), never the
    newest nor those in ``keep`` (``NxDTrainer``'s best checkpoint: as ``Trainer``'s rotation)."""
    complete = read_tracker(path)["complete"]
    protected = {complete[-1], *keep} if complete else set(keep)
    excess = len(complete) - max(num_kept, len(protected & set(complete)))
    dropped = [t for t in complete if t not in protected][: max(0, excess)]
    if not dropped:
        return
    kept = [t for t in complete if t not in dropped]
    write_tracker(path, kept[-1], kept)
    for tag in dropped:
        shutil.rmtree(os.path.join(path, dir_name(tag)), ignore_errors=True)


def resolve(path: str, tag: str | None) -> tuple[str | None, str | None]:
    """(checkpoint directory, None) or (None, what is wrong)."""
    if not os.path.isdir(path):
        return None, f"checkpoint path {path} does not exist or is not a directory"
    if tag is None and os.path.exists(os.path.join(path, DONE)) and os.path.exists(os.path.join(path, INDEX)):
        return path, None  # one checkpoint's own directory (out/checkpoint-18 of NxDTrainer)
    if tag is None:
        tag = read_tracker(path)["newest"]
        if tag is None:
            return None, _saving(path, "*") or (
                f"{path} is not an nxd_hf checkpoint directory: it has no {TRACKER} naming the newest "
                "checkpoint. Pass the directory save_checkpoint wrote to, or a tag")
    name = dir_name(tag)
    directory = os.path.join(path, name)
    if not os.path.isdir(directory):
        old = os.path.join(path, f".{name}.old")
        if os.path.exists(os.path.join(old, DONE)):  # a crash between the two renames of a re-save
            return old, None
        tags = read_tracker(path)["complete"]
        return None, _saving(path, name) or f"no checkpoint with tag {tag!r} in {path} (complete checkpoints: {tags})"
    if not os.path.exists(os.path.join(directory, DONE)):
        return None, f"checkpoint {directory} is incomplete (no '{DONE}' marker): its save never finished"
    if not os.path.exists(os.path.join(directory, INDEX)):
        return None, f"checkpoint {directory} has no {INDEX}: it was not written by nxd_hf.save_checkpoint"
    return directory, None


def _saving(path: str, name: str) -> str | None:
    """What to say when the checkpoint asked for is still a temporary directory (no completion marker)."""
    tmps = sorted(glob.glob(os.path.join(path, f".{name}.tmp")))
    if not tmps:
        return None
    return (f"the checkpoint in {path} is not complete yet: a save into {', '.join(tmps)} is in progress or was "
            "interrupted (no completion marker). After save_checkpoint(..., async_save=True) in another process, "
            "wait for that save to finish (nxd_hf.wait_for_checkpoint() in the saving job); if the job died, save "
            f"again (complete checkpoints there: {complete_tags(path)})")


def read_index(directory: str) -> tuple[dict | None, str | None]:
    try:
        with open(os.path.join(directory, INDEX), "rb") as f:
            data = f.read()
        problem = index_problem(directory, data)
        if problem is not None:
            return None, problem
        index = json.loads(data)
    except (OSError, ValueError) as error:
        return None, f"{os.path.join(directory, INDEX)} cannot be read: {error}"
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return None, f"{os.path.join(directory, INDEX)} is not an nxd_hf checkpoint index"
    return index, None


def what_to_do(path: str, directory: str | None) -> str:
    """The advice that ends every damaged-checkpoint message."""
    others = [t for t in complete_tags(path) if directory is None or os.path.join(path, t) != os.path.normpath(directory)]
    if not others:
        return (f"no other complete checkpoint is in {path}: save a new one (this one cannot be used as it is; "
                "restore the file from a copy if you have one)")
    return (f"load an older checkpoint: load_checkpoint({path!r}, tag={others[-1]!r}) or "
            f"`nxd-hf consolidate {path} --tag {others[-1]} ...` (complete checkpoints there: {others})")
