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
import json
import os
import shutil

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


def read_tracker(path: str) -> dict:
    tracker = os.path.join(path, TRACKER)
    if not os.path.exists(tracker):
        return {"newest": None, "complete": []}
    with open(tracker) as f:
        return json.load(f)


def finalize(path: str, tag: str, index: dict, num_kept_ckpts: int | None) -> None:
    """Rank 0, once every rank's files are in the temporary directory: make it the checkpoint."""
    tmp, name = tmp_dir(path, tag), dir_name(tag)
    write_json_atomic(os.path.join(tmp, INDEX), index)
    with durable_open(os.path.join(tmp, DONE), "w") as f:
        f.write("complete\n")
    fsync_dir(tmp)
    final, old = os.path.join(path, name), os.path.join(path, f".{name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(path)
    tracker = read_tracker(path)
    complete = [t for t in tracker["complete"] if t != tag] + [tag]
    write_json_atomic(os.path.join(path, TRACKER), {"newest": tag, "complete": complete})
    shutil.rmtree(old, ignore_errors=True)
    if num_kept_ckpts is not None:
        _prune(path, complete, num_kept_ckpts)


def _prune(path: str, complete: list[str], num_kept: int) -> None:
    """Delete the oldest complete checkpoints beyond ``num_kept`` (the tracker first)."""
    dropped, kept = complete[: max(0, len(complete) - num_kept)], complete[max(0, len(complete) - num_kept) :]
    if not dropped:
        return
    write_json_atomic(os.path.join(path, TRACKER), {"newest": kept[-1], "complete": kept})
    for tag in dropped:
        shutil.rmtree(os.path.join(path, dir_name(tag)), ignore_errors=True)


def resolve(path: str, tag: str | None) -> tuple[str | None, str | None]:
    """(checkpoint directory, None) or (None, what is wrong)."""
    if not os.path.isdir(path):
        return None, f"checkpoint path {path} does not exist or is not a directory"
    if tag is None:
        tag = read_tracker(path)["newest"]
        if tag is None:
            return None, (f"{path} is not an nxd_hf checkpoint directory: it has no {TRACKER} naming the newest "
                          "checkpoint. Pass the directory save_checkpoint wrote to, or a tag")
    name = dir_name(tag)
    directory = os.path.join(path, name)
    if not os.path.isdir(directory):
        old = os.path.join(path, f".{name}.old")
        if os.path.exists(os.path.join(old, DONE)):  # a crash between the two renames of a re-save
            return old, None
        tags = read_tracker(path)["complete"]
        return None, f"no checkpoint with tag {tag!r} in {path} (complete checkpoints: {tags})"
    if not os.path.exists(os.path.join(directory, DONE)):
        return None, f"checkpoint {directory} is incomplete (no '{DONE}' marker): its save never finished"
    if not os.path.exists(os.path.join(directory, INDEX)):
        return None, f"checkpoint {directory} has no {INDEX}: it was not written by nxd_hf.save_checkpoint"
    return directory, None


def read_index(directory: str) -> tuple[dict | None, str | None]:
    try:
        with open(os.path.join(directory, INDEX)) as f:
            index = json.load(f)
    except (OSError, ValueError) as error:
        return None, f"{os.path.join(directory, INDEX)} cannot be read: {error}"
    if index.get("format") != FORMAT:
        return None, f"{os.path.join(directory, INDEX)} is not an nxd_hf checkpoint index"
    return index, None
